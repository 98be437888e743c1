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
from collections.abc import AsyncGenerator, Awaitable, Coroutine
from typing import Any, TypeVar

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


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class DisconnectWatch:
    """Cancels the current task when the client goes away, until ``stop()``.

    The work runs in the caller's task, and the watch is no task either: it steps a
    coroutine that awaits ``receive()`` until ``http.disconnect`` itself, as a Task would
    (on each future it awaits, or at the loop's next turn after a bare yield), so watching
    costs no Task, no cancellation and no extra turn of the loop per request (about half
    of what it cost). ``receive()`` returning ``http.disconnect``, or raising, means the
    client is gone; ``stop()`` closes the coroutine where it waits (its ``finally`` blocks
    run, as a cancellation's would)."""

    __slots__ = ("_task", "_coro", "_awaiting", "_watching", "_disconnected")

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._watching = True
        self._disconnected = False
        self._awaiting: asyncio.Future[None] | None = None
        self._coro: Coroutine[Any, Any, None] = _wait_for_disconnect(receive)
        self._step()

    def _step(self, _done: object = None) -> None:
        """Run the watching coroutine to its next suspension (Task.__step without the Task)."""
        if not self._watching:  # stopped while this step was scheduled
            return
        self._awaiting = None
        try:
            yielded = self._coro.send(None)
        except StopIteration:  # http.disconnect
            self._on_disconnect()
        except asyncio.CancelledError:  # what receive() awaited was cancelled: not a disconnect
            self._watching = False
        except Exception:  # noqa: BLE001  # receive() failed: the connection is gone
            self._on_disconnect()
        else:
            if yielded is None:  # a bare yield (sleep(0)): go on at the loop's next turn
                asyncio.get_running_loop().call_soon(self._step)
            else:  # a future: go on when it is done
                yielded._asyncio_future_blocking = False
                yielded.add_done_callback(self._step)
                self._awaiting = yielded

    def _on_disconnect(self) -> None:
        self._watching = False
        self._disconnected = True
        self._task.cancel()

    def cancelled_us(self) -> bool:
        """In an ``except CancelledError``: True (and the cancellation consumed) when it
        was this watch's, because the client left; False when someone else cancelled."""
        return self._disconnected and self._task.uncancel() == 0

    def stop(self) -> None:
        if not self._watching:
            return
        self._watching = False
        if self._awaiting is not None:
            self._awaiting.remove_done_callback(self._step)
            self._awaiting = None
        self._coro.close()
