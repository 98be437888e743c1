"""Server-sent events and client disconnects.

A client that goes away must abort its request in the engine at once, not
when the next token happens to fail to send (uvicorn drops writes to a
closed connection silently). ``EventStreamResponse`` therefore watches
``http.disconnect`` while it streams and, on every exit path, closes the
event iterator; closing it closes the engine client's ``generate()``
iterator underneath, which aborts the request. ``run_until_disconnect``
does the same for a non-streaming request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncGenerator, Awaitable, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

__all__ = ["EventStreamResponse", "ClientDisconnected", "run_until_disconnect"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # no proxy buffering of tokens
]


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
        self.raw_headers = list(_SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait((stream, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stream.cancel()
            watcher.cancel()
            failure, _ = await asyncio.gather(stream, watcher, return_exceptions=True)
            await self.events.aclose()
        if isinstance(failure, Exception) and not isinstance(failure, OSError):
            logger.error("event stream failed", exc_info=failure)

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for frame in self.events:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def run_until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """``await work``, cancelling it (and raising ClientDisconnected) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected()
    return task.result()
