"""Admission control: a bound on the requests one worker generates for at once.

A worker with K frontends admits at most ``max_concurrent_requests`` generation
requests; each frontend admits its share, ``ceil(limit / K)``, counted in its
own process (the kernel spreads connections over the K frontends, so the shares
fill about evenly; a frontend never asks another or the engine, which keeps
the check free: one integer compare per request). A request over the share is
answered at once with 429 and ``Retry-After`` in the route's API shape, before
its body is read: an overloaded worker refuses in microseconds instead of
queueing without bound, and the orchestrator tries another worker.

A second bound is on the queue (``QueueBound``): the requests a frontend sent
to its engine that have no first token yet, and their prompt tokens
(``max_queued_requests``, ``max_queued_prompt_tokens``, each frontend its
share). It is checked when the prompt is tokenized, before the request reaches
the engine, so a worker whose queue would make a new request wait long refuses
it at once even while it is under its concurrent-request limit (long prompts
fill a queue long before the count of requests does). A lone request is never
refused for its tokens: the queue would otherwise refuse it forever.

Every refusal is ``OverloadedError``: 429 ``rate_limit_error`` in OpenAI's
shape, 529 ``overloaded_error`` in Anthropic's (its API's status for "busy,
retry"), both with ``Retry-After``; each is counted by the limit that refused
it (``on_refused``: the process's Prometheus counter).

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
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import FrontendError, anthropic_error_body, http_error, openai_error_body

__all__ = ["ADMITTED_PATHS", "RETRY_AFTER_SECONDS", "OVERLOADED_STATUSES", "AdmissionGate", "AdmissionMiddleware",
           "OverloadedError", "QueueBound", "QueueTicket", "Limit", "OnRefused", "per_frontend_limit",
           "default_max_concurrent_requests"]

ADMITTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"})
RETRY_AFTER_SECONDS = 1
OVERLOADED_STATUSES = frozenset({429, 529})  # a worker's "busy, try another": OpenAI's and Anthropic's


class Limit:
    """The admission limits, as the refusal counter's ``limit`` label."""

    CONCURRENT_REQUESTS = "concurrent_requests"
    QUEUED_REQUESTS = "queued_requests"
    QUEUED_PROMPT_TOKENS = "queued_prompt_tokens"
    WORKERS = "workers"  # the orchestrator: every worker it tried refused
    ALL = (CONCURRENT_REQUESTS, QUEUED_REQUESTS, QUEUED_PROMPT_TOKENS, WORKERS)


OnRefused = Callable[[str], None]  # called with the ``Limit`` that refused a request


class OverloadedError(FrontendError):
    """429 (Anthropic: 529 ``overloaded_error``) with Retry-After: the worker (or, at the orchestrator,
    every worker) is at one of its admission limits."""

    status = 429
    openai_type = "rate_limit_error"
    anthropic_type = "overloaded_error"
    anthropic_status = 529
    code = "too_many_requests"
    retry_after = RETRY_AFTER_SECONDS


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
        self.on_refused: OnRefused | None = None

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
        """The error of a request refused now (counted)."""
        if self.on_refused is not None:
            self.on_refused(Limit.CONCURRENT_REQUESTS)
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
            await Response(body, status_code=error.status_for(anthropic), media_type="application/json",
                           headers=error.headers())(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            gate.release()


class QueueTicket:
    """One queued request's place in its ``QueueBound``; ``leave`` (idempotent) when it starts
    (its first token) or ends."""

    __slots__ = ("bound", "num_tokens")

    def __init__(self, bound: QueueBound, num_tokens: int) -> None:
        self.bound: QueueBound | None = bound
        self.num_tokens = num_tokens

    def leave(self) -> None:
        bound, self.bound = self.bound, None
        if bound is not None:
            bound.num_queued -= 1
            bound.num_queued_tokens -= self.num_tokens


class QueueBound:
    """This process's share of a bound on queued requests and their prompt tokens (None: unbounded).

    Queued: handed on (to the engine, or by the orchestrator to the workers) and without a first
    token yet. ``enter`` admits a request or raises ``OverloadedError`` (counted); a request alone
    in the queue is admitted whatever its length."""

    def __init__(self, max_requests: int | None, max_tokens: int | None, holder: str,
                 on_refused: OnRefused | None = None) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.holder = holder  # who refuses, in the error message
        self.on_refused = on_refused
        self.num_queued = 0
        self.num_queued_tokens = 0

    @property
    def bounded(self) -> bool:
        return self.max_requests is not None or self.max_tokens is not None

    def check(self, num_tokens: int) -> None:
        """Raise ``OverloadedError`` (counted) when a request of ``num_tokens`` prompt tokens would
        go over a bound now."""
        if self.max_requests is not None and self.num_queued >= self.max_requests:
            raise self._refuse(Limit.QUEUED_REQUESTS, f"{self.num_queued} requests queued, at most "
                                                      f"{self.max_requests}")
        if (self.max_tokens is not None and self.num_queued
                and self.num_queued_tokens + num_tokens > self.max_tokens):
            raise self._refuse(Limit.QUEUED_PROMPT_TOKENS,
                               f"{self.num_queued_tokens} prompt tokens queued, at most {self.max_tokens} with "
                               f"this request's {num_tokens}")

    def enter(self, num_tokens: int) -> QueueTicket | None:
        """The request's ticket, after ``check`` (None when nothing is bounded: nothing to leave)."""
        if not self.bounded:
            return None
        self.check(num_tokens)
        return self.add(num_tokens)

    def add(self, num_tokens: int) -> QueueTicket | None:
        """Count a request checked before (the engine client: its frontend checked it when it was
        prepared, before a stream's head went out); never refuses."""
        if not self.bounded:
            return None
        self.num_queued += 1
        self.num_queued_tokens += num_tokens
        return QueueTicket(self, num_tokens)

    def _refuse(self, limit: str, why: str) -> OverloadedError:
        if self.on_refused is not None:
            self.on_refused(limit)
        return OverloadedError(f"{self.holder} is overloaded ({why}); retry after {RETRY_AFTER_SECONDS} s")
