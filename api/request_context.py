"""Where a request enters a worker frontend: its ids into the context its task runs in.

``enter_request(scope)`` reads the ``x-request-id`` and ``traceparent``
headers in one scan of the ASGI scope (``api.request_headers``: the
lower-case names of the ASGI spec) and sets ``common.log_format.REQUEST_ID``
(every log line of the request's task names it, uvicorn's access line
included: it is written from the same task) and ``TRACEPARENT``, which the
engine client keeps on the request's track and hands, with its perf record,
to the tracer when the request ends (``api.tracing``). An orchestrator's
``x-disagg-stream-marks: 1`` sets ``api.stream_marks.STREAM_MARKS``: the
request's stream marks the tokens of each write.
"""

from __future__ import annotations

from contextvars import ContextVar

from starlette.types import Scope

from api.request_headers import X_REQUEST_ID
from api.stream_marks import MARKS_HEADER, STREAM_MARKS
from common.log_format import REQUEST_ID

__all__ = ["enter_request", "TRACEPARENT"]

TRACEPARENT: ContextVar[str | None] = ContextVar("disagg_traceparent", default=None)
"""The W3C ``traceparent`` the request came with (None: none)."""

_TRACEPARENT = b"traceparent"
_MARKS = MARKS_HEADER.encode()


def enter_request(scope: Scope) -> str | None:
    """The request's ``x-request-id`` (None: none), both headers set in the task's context."""
    request_id = traceparent = None
    for key, value in scope["headers"]:
        if key == X_REQUEST_ID:
            if request_id is None:
                request_id = value.decode("latin-1")
        elif key == _TRACEPARENT and traceparent is None:
            traceparent = value.decode("latin-1")
        elif key == _MARKS and value == b"1":
            STREAM_MARKS.set(True)
    if request_id is not None:
        REQUEST_ID.set(request_id)
    if traceparent is not None:
        TRACEPARENT.set(traceparent)
    return request_id
