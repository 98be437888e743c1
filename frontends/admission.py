"""Admission control: a bound on the requests one worker generates for at once.

A worker with K frontends admits at most ``max_concurrent_requests`` generation
requests; each frontend admits its share, ``ceil(limit / K)``, counted in its
own process (the kernel spreads connections over the K frontends, so the shares
fill about evenly; a frontend never asks another or the engine, which keeps
the check free: one integer compare per request). A request over the share is
answered at once with 429 and ``Retry-After`` in the route's API shape, before
its body is read: an overloaded worker refuses in microseconds instead of
queueing without bound, and the orchestrator tries another worker.

Only generation routes count (``ADMITTED_PATHS``); ``/health``, ``/metrics``,
``/v1/models`` and the launcher's routes are never refused, so routers and
operators still see a busy worker. A streaming request holds its slot until
its stream ends.

The orchestrator bounds each of its processes the same way
(``AdmissionMiddleware``, ``orchestrator.max_concurrent_requests``). Per
connection nothing more is needed: HTTP/1.1 answers one request at a time on a
connection (uvicorn stops reading a connection while a request on it runs, so
pipelined requests wait in the socket, in order) and HTTP/2 is not served, so
one connection holds at most one admitted request.
"""

from __future__ import annotations

import math

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from frontends.errors import FrontendError, anthropic_error_body, http_error, openai_error_body

__all__ = ["ADMITTED_PATHS", "RETRY_AFTER_SECONDS", "AdmissionGate", "AdmissionMiddleware", "OverloadedError",
           "per_frontend_limit", "default_max_concurrent_requests"]

ADMITTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"})
RETRY_AFTER_SECONDS = 1


class OverloadedError(FrontendError):
    """429: the worker (or, at the orchestrator, every worker) is at its concurrent-request limit."""

    status = 429
    openai_type = "rate_limit_error"
    anthropic_type = "rate_limit_error"
    code = "too_many_requests"


def default_max_concurrent_requests(max_num_seqs: int) -> int:
    """A worker's limit when none is configured: four batches' worth. Requests past one batch wait
    in the engine's queue (and are scheduled as others finish); past four, a client is better off
    with an immediate 429 and another worker than with a queue it would wait minutes in."""
    return 4 * max_num_seqs


def per_frontend_limit(max_concurrent_requests: int | None, num_frontends: int) -> int | None:
    """Each frontend's share of its worker's limit (None: no limit)."""
    if not max_concurrent_requests:
        return None
    return max(1, math.ceil(max_concurrent_requests / num_frontends))


class AdmissionGate:
    """Counts this frontend's admitted requests against ``limit`` (None: admits everything)."""

    def __init__(self, limit: int | None, holder: str = "this worker", share: str = " per frontend") -> None:
        self.limit = limit
        self.num_admitted = 0
        self.holder = holder  # who refuses, in the error message
        self.share = share

    def gates(self, method: str, path: str) -> bool:
        return self.limit is not None and method == "POST" and path in ADMITTED_PATHS

    def try_admit(self) -> bool:
        assert self.limit is not None
        if self.num_admitted >= self.limit:
            return False
        self.num_admitted += 1
        return True

    def release(self) -> None:
        self.num_admitted -= 1

    def refusal(self) -> OverloadedError:
        return OverloadedError(f"{self.holder} is at its limit of concurrent requests ({self.limit}{self.share}); "
                               f"retry after {RETRY_AFTER_SECONDS} s")


class AdmissionMiddleware:
    """``AdmissionGate`` as an ASGI layer (the orchestrator's processes): a generation request over
    the limit gets 429 with ``Retry-After`` in its route's API shape before its body is read."""

    def __init__(self, app: ASGIApp, gate: AdmissionGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gate = self.gate
        if scope["type"] != "http" or not gate.gates(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        if not gate.try_admit():
            error = http_error(gate.refusal())
            anthropic = scope["path"].startswith("/v1/messages")
            body = anthropic_error_body(error) if anthropic else openai_error_body(error)
            await Response(body, status_code=error.status, media_type="application/json",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            gate.release()
