"""Every answer ends in the API's shape, whatever cut it: the orchestrator's outermost middleware.

The endpoints map their own exceptions to JSON errors (``orchestrator.app``),
but some ends happen outside them, and uvicorn answers those with a plain-text
``Internal Server Error`` or a bare connection close:

- an exception that escapes a handler or a middleware (a bug): 500 in JSON;
- a cancellation (the graceful-shutdown window ran out with the request still
  in flight): 503 in JSON, and the cancellation propagates;
- an event stream that stops before its end (any of the above after the first
  byte, or a producer that gave up): the API's error event, and ``data: [DONE]``
  for OpenAI, so that a client's SDK raises instead of waiting or silently
  taking a truncated answer.

Anthropic's shape under /v1/messages, OpenAI's elsewhere (``api.route_errors``).
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import ApiError, anthropic_error_body, openai_error_body
from api.route_errors import is_anthropic_path

__all__ = ["CleanEndsMiddleware", "stream_error_frame", "SHUTTING_DOWN", "INTERNAL_ERROR", "STREAM_CUT"]

log = logging.getLogger("disagg.orchestrator")

SHUTTING_DOWN = ApiError(503, "the orchestrator is shutting down; retry", "service_unavailable_error",
                          "overloaded_error", code="shutting_down")
INTERNAL_ERROR = ApiError(500, "internal error", "internal_error", "api_error")
STREAM_CUT = ApiError(502, "the stream ended before its end", "upstream_error", "api_error", code="stream_cut")


def stream_error_frame(anthropic: bool, error: ApiError) -> bytes:
    """The API's in-stream error: Anthropic's ``error`` event, or OpenAI's error data then [DONE]."""
    if anthropic:
        return b"event: error\ndata: " + anthropic_error_body(error) + b"\n\n"
    return b"data: " + openai_error_body(error) + b"\n\ndata: [DONE]\n\n"


class CleanEndsMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        anthropic = is_anthropic_path(scope.get("path", ""))
        response = _ResponseState(send)
        try:
            await self.app(scope, receive, response.send)
        except asyncio.CancelledError:
            await response.end(anthropic, SHUTTING_DOWN)
            raise
        except Exception as exc:  # logged here; the client gets JSON, not uvicorn's text
            log.error("%s %s failed outside its handler", scope.get("method"), scope.get("path"), exc_info=exc)
            await response.end(anthropic, INTERNAL_ERROR)
            return
        if response.stream_open:  # the producer stopped without ending the stream
            await response.end(anthropic, STREAM_CUT)


class _ResponseState:
    """What has gone out so far, so that the end can be completed in the right shape."""

    __slots__ = ("_send", "started", "complete", "event_stream", "_last")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = self.complete = self.event_stream = False
        self._last = b"\n\n"

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                    for k, v in message.get("headers", ()))
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            if body:
                self._last = body
            self.complete = not message.get("more_body", False)
        await self._send(message)

    @property
    def stream_open(self) -> bool:
        return self.started and self.event_stream and not self.complete

    async def end(self, anthropic: bool, error: ApiError) -> None:
        try:
            if not self.started:
                body = anthropic_error_body(error) if anthropic else openai_error_body(error)
                await self.send({"type": "http.response.start", "status": error.status,
                                 "headers": [(b"content-type", b"application/json"),
                                             (b"content-length", str(len(body)).encode())]})
                await self.send({"type": "http.response.body", "body": body, "more_body": False})
            elif self.stream_open:
                sep = b"" if self._last.endswith(b"\n\n") else b"\n\n"
                await self.send({"type": "http.response.body", "body": sep + stream_error_frame(anthropic, error),
                                 "more_body": False})
        except (OSError, RuntimeError):  # the connection is gone, or the server refuses more: nothing to tell
            pass
