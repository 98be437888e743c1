"""Server-sent events and client disconnects.

A client that goes away must abort its request in the engine at once, not
when the next token happens to fail to send (uvicorn drops writes to a
closed connection silently). ``EventStreamResponse`` therefore watches
``http.disconnect`` while it streams and, on every exit path, closes the
event iterator; closing it closes the engine client's ``generate()``
iterator underneath, which aborts the request. ``run_until_disconnect``
does the same for a non-streaming request.

Writes are the frontend's main per-token cost (each is an ASGI message
through the middleware and a socket write): a producer that knows its
last bytes yields them as a ``FinalFrame``, which goes out in one write
with the end of the response.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncGenerator, Awaitable, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

__all__ = ["DisconnectWatch", "EventStreamResponse", "FinalFrame", "ClientDisconnected", "SSE_HEADERS",
           "run_until_disconnect"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # no proxy buffering of tokens
]


class FinalFrame(bytes):
    """The last bytes of an event stream: sent together with the end of the response."""


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was complete."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(Response):
    """Streams pre-encoded SSE frames (bytes) from an async generator."""

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.raw_headers = list(SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = DisconnectWatch(receive)
        try:
            await self._stream(send)
        except asyncio.CancelledError:
            if not watch.cancelled_us():  # anyone else's cancellation propagates
                raise
        except OSError:
            pass
        except Exception as exc:  # the status line is out: nothing else to tell the client
            logger.error("event stream failed", exc_info=exc)
        finally:
            watch.stop()
            await self.events.aclose()

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for frame in self.events:
            if type(frame) is FinalFrame:
                await send({"type": "http.response.body", "body": bytes(frame), "more_body": False})
                return
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def run_until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """``await work``, cancelling it (and raising ClientDisconnected) if the client leaves."""
    watch = DisconnectWatch(receive)
    try:
        return await work
    except asyncio.CancelledError:
        if not watch.cancelled_us():
            raise
        raise ClientDisconnected() from None
    finally:
        watch.stop()


class DisconnectWatch:
    """Cancels the current task when the client goes away, until ``stop()``.

    The work runs in the caller's task (no second task, no ``asyncio.wait``:
    per request, that was most of the cost of watching)."""

    __slots__ = ("_task", "_watcher", "_watching", "_disconnected")

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._watching = True
        self._disconnected = False
        self._watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        self._watcher.add_done_callback(self._on_disconnect)

    def _on_disconnect(self, watcher: asyncio.Future) -> None:
        if self._watching and not watcher.cancelled():
            self._disconnected = True
            self._task.cancel()

    def cancelled_us(self) -> bool:
        """In an ``except CancelledError``: True (and the cancellation consumed) when it
        was this watch's, because the client left; False when someone else cancelled."""
        return self._disconnected and self._task.uncancel() == 0

    def stop(self) -> None:
        self._watching = False
        self._watcher.cancel()
