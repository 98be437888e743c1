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
"""

from __future__ import annotations

import math

from frontends.errors import FrontendError

__all__ = ["ADMITTED_PATHS", "RETRY_AFTER_SECONDS", "AdmissionGate", "OverloadedError", "per_frontend_limit"]

ADMITTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"})
RETRY_AFTER_SECONDS = 1


class OverloadedError(FrontendError):
    """429: the worker (or, at the orchestrator, every worker) is at its concurrent-request limit."""

    status = 429
    openai_type = "rate_limit_error"
    anthropic_type = "rate_limit_error"
    code = "too_many_requests"


def per_frontend_limit(max_concurrent_requests: int | None, num_frontends: int) -> int | None:
    """Each frontend's share of its worker's limit (None: no limit)."""
    if not max_concurrent_requests:
        return None
    return max(1, math.ceil(max_concurrent_requests / num_frontends))


class AdmissionGate:
    """Counts this frontend's admitted requests against ``limit`` (None: admits everything)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.num_admitted = 0

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
        return OverloadedError(f"this worker is at its limit of concurrent requests ({self.limit} per frontend); "
                               f"retry after {RETRY_AFTER_SECONDS} s")
