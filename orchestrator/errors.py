"""The orchestrator's additions to the frontends' error tree (``api.errors``)::

    FrontendError
    ├── NoWorkerError        503: no healthy worker for a leg, or every one tried said it is unavailable
    ├── UpstreamFailedError  502: every worker tried for a leg failed (after retries)
    ├── RequestTimeoutError  504: the request ran past timeouts.request_seconds
    └── UnauthorizedError    401: missing or wrong API key (``api.errors``, re-exported)

A worker's own 4xx answer is passed to the client unchanged (``UpstreamRejected``).
"""

from __future__ import annotations

import msgspec

from api.errors import FrontendError, UnauthorizedError

__all__ = ["NoWorkerError", "UpstreamFailedError", "RequestTimeoutError", "UnauthorizedError",
           "UpstreamRejected", "LegFailed", "WorkerErrorDetail", "error_detail"]


class NoWorkerError(FrontendError):
    status = 503
    openai_type = "service_unavailable_error"
    anthropic_type = "overloaded_error"
    code = "no_worker"


class UpstreamFailedError(FrontendError):
    status = 502
    openai_type = "upstream_error"
    anthropic_type = "api_error"
    code = "upstream_failed"


class RequestTimeoutError(FrontendError):
    status = 504
    openai_type = "timeout_error"
    anthropic_type = "api_error"
    code = "timeout"


class UpstreamRejected(Exception):
    """A worker answered 4xx: the client's request is at fault; its body goes back verbatim."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"worker answered {status}")
        self.status = status
        self.body = body

    @property
    def refuses_the_leg(self) -> bool:
        """The worker cannot run a disaggregated leg (no cluster key, wrong role): the 400 names
        ``disaggregated_params``, which only the orchestrator sets (a client's is refused up front),
        so it is about the worker, not the client's request."""
        detail = error_detail(self.body)
        return self.status == 400 and detail is not None and detail.param == "disaggregated_params"


class WorkerErrorDetail(msgspec.Struct):
    param: str | None = None
    code: str | None = None


class _WorkerErrorBody(msgspec.Struct):
    """What the orchestrator reads of a worker's error body, OpenAI's ``{"error": {..., "param",
    "code"}}`` or Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (no code)."""

    error: WorkerErrorDetail | None = None


_ERROR_BODY = msgspec.json.Decoder(_WorkerErrorBody)


def error_detail(content: bytes) -> WorkerErrorDetail | None:
    """The ``error`` object of a worker's error body; None for anything else (not JSON, not that shape)."""
    try:
        return _ERROR_BODY.decode(content).error
    except msgspec.DecodeError:  # ValidationError included
        return None


class LegFailed(Exception):
    """A worker failed a leg (no connection, timeout, 5xx): retry elsewhere.

    ``refused``: the worker answered 429 (at its concurrent-request limit): it is busy, not
    failing, so it is not suspected, and when every worker tried refused the client gets 429.

    ``unanswered``: no answer came (no connection, timeout, connection lost): the worker is suspect.
    ``connection_lost``: of those, a connection lost after it was made (one frontend process died,
    perhaps not the worker): the same worker may be tried once more.

    ``unavailable``: the worker answered 503 (its engine is dead or stalled, it is shutting down): it
    said so itself, so when every worker tried did, the client gets a retryable 503, not a 502."""

    def __init__(self, message: str, refused: bool = False,
                 unanswered: bool = False, connection_lost: bool = False, unavailable: bool = False) -> None:
        super().__init__(message)
        self.unavailable = unavailable
        self.refused = refused
        self.unanswered = unanswered
        self.connection_lost = connection_lost
