"""Streamed generations pushed from the engine client's lane reader (issue 17 item 1).

Pulled (``generation.stream_events``), every SSE event wakes the request's
task, which resumes four nested async iterators (``generate()``,
``pieces()``, ``stream_events``, the response) to write one frame. Pushed,
the lane reader runs an event's whole path synchronously as its output
arrives: cut the piece, encode the frame, write it through the ASGI
``send``, stepped by hand (it completes without suspending unless the
transport is paused). The request's task only starts the response, waits
for the end and owns the cleanup: a client that goes away cancels it
(``streaming.DisconnectWatch``), and closing the engine request aborts it
in the engine, as leaving ``generate()`` does.

Middle frames skip ``send`` where the server lets them (``api.direct_body``):
written straight to the transport, chunked as uvicorn would.

Backpressure: a send that suspends (the transport is paused) is handed to
the request's task, and the frames that follow are held, joined, until it
has drained; frames never reorder.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Coroutine, Generator
from typing import Any, cast

from starlette.types import Receive, Scope, Send

from api.direct_body import DirectBody
from api.errors import ApiError, http_error
from api.generation import Generation, Piece, PieceCutter, StreamEncoder, start_frames, stream_events
from api.streaming import SSE_HEADERS, DisconnectWatch, EventStreamResponse
from workers.protocol import RequestOutput

__all__ = ["PushedStreamResponse", "stream_response"]

logger = logging.getLogger(__name__)


def stream_response(generation: Generation, encoder: StreamEncoder) -> EventStreamResponse:
    """The SSE response of a streamed generation: pushed where the engine client can push
    (``EngineClient.open_stream``), else pulled (a stand-in client in a test or benchmark)."""
    if hasattr(generation.client, "open_stream"):
        return PushedStreamResponse(generation, encoder)
    return EventStreamResponse(stream_events(generation, encoder))


class _Suspended:
    """A send coroutine that was stepped by hand and suspended: awaiting this finishes it."""

    __slots__ = ("coro", "waiting_on")

    def __init__(self, coro: Coroutine[Any, Any, None], waiting_on: Any) -> None:
        self.coro = coro
        self.waiting_on = waiting_on

    def __await__(self) -> Generator[Any, None, None]:
        try:
            yield self.waiting_on  # what the coroutine yielded to its (absent) task: the awaiting task takes it
        except BaseException:
            self.coro.close()
            raise
        yield from self.coro.__await__()  # resumes it where it stopped, as its task would have

    def close(self) -> None:
        self.coro.close()


def _step(send: Send, message: dict[str, Any]) -> _Suspended | None:
    """Run ``send(message)`` now; None when it completed, else what must be awaited to finish it."""
    # uvicorn's and our middleware's: async defs (a quoted cast: subscripting typing costs ~0.6 us a call).
    coro = cast("Coroutine[Any, Any, None]", send(message))
    try:
        waiting_on = coro.send(None)
    except StopIteration:
        return None
    return _Suspended(coro, waiting_on)


class PushedStreamResponse(EventStreamResponse):
    """A streamed generation written by the lane reader; ``events`` is the same stream pulled
    (for a wrapper that re-encodes it: the Responses API)."""

    def __init__(self, generation: Generation, encoder: StreamEncoder) -> None:  # not super()'s: it would set events
        self.generation = generation
        self.encoder = encoder
        self.status_code = 200
        self.background = None
        self.raw_headers = list(SSE_HEADERS)

    @property
    def events(self) -> AsyncGenerator[bytes, None]:  # type: ignore[override]
        return stream_events(self.generation, self.encoder)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _PushedStream(self.generation, self.encoder, send, DirectBody.of(scope)).run(receive, self.raw_headers)


class _PushedStream:
    __slots__ = ("generation", "encoder", "send", "direct", "cutter", "request", "pending", "held", "suspended",
                 "final", "wake")

    def __init__(self, generation: Generation, encoder: StreamEncoder, send: Send, direct: DirectBody | None
                 ) -> None:
        self.generation = generation
        self.encoder = encoder
        self.send = send
        self.direct = direct  # the middle frames' way around send, where the server offers one
        self.cutter = PieceCutter(generation)
        self.request: Any = None  # the engine client's PushedRequest, once open
        self.pending = b""  # the start frames go out with the first piece's (``run``)
        self.held: list[bytes] = []  # frames produced while the request's task owns the writes
        self.suspended: _Suspended | None = None  # set: the request's task owns the writes
        self.final = False  # the last frame is written or held
        self.wake = asyncio.get_running_loop().create_future()

    async def run(self, receive: Receive, headers: list[tuple[bytes, bytes]]) -> None:
        watch = DisconnectWatch(receive)
        try:
            await self.send({"type": "http.response.start", "status": 200, "headers": headers})
            try:
                self.pending = start_frames(self.generation, self.encoder, self.cutter)
                # Early tokens (a gen leg's first) are cut first: a stop string among them ends the
                # request before the engine sees it; else they go out right after it was sent.
                early = self.cutter.cut_early()
                if early is None or early.finish_reason is None:
                    self.request = self.generation.open_stream(self.on_output)
                if early is not None:
                    self._emit(early)
            except Exception as exc:  # noqa: BLE001  # refused (a dead engine) or failed: on_output reports it
                self.on_output(exc)
            await self._wait()
        except asyncio.CancelledError:
            if not watch.cancelled_us():  # anyone else's cancellation propagates
                raise
        except OSError:
            pass
        finally:
            watch.stop()
            if self.request is not None:
                self.request.close()  # aborts it in the engine unless it finished
            if self.suspended is not None:
                self.suspended.close()

    async def _wait(self) -> None:
        """Until the last frame is out; writes what the reader handed over (backpressure)."""
        while True:
            await self.wake
            self.wake = asyncio.get_running_loop().create_future()
            if self.suspended is not None:  # the reader holds its frames until this is None again
                await self.suspended
                while self.held:
                    data = b"".join(self.held)
                    self.held.clear()
                    await self.send({"type": "http.response.body", "body": data, "more_body": not self.final})
                self.suspended = None
            if self.final:
                return

    def on_output(self, item: RequestOutput | Exception) -> None:
        """From the lane reader: this request's next output, or why there will be none (the
        engine died: an ``EngineDeadError``). Never raises: errors go to the client in band."""
        if self.final:
            return
        try:
            if isinstance(item, Exception):
                raise item
            piece = self.cutter.cut(item)
            if piece is not None:
                self._emit(piece)
        except Exception as exc:  # reported to the client in the stream
            error = http_error(exc)
            if error.status >= 500:
                logger.error("stream failed", exc_info=exc)
            self.fail(error)

    def _emit(self, piece: Piece) -> None:
        frame = self.encoder.piece(piece)
        if piece.finish_reason is None:
            if frame is not None:
                mark = self.cutter.mark()
                self._write(self.pending + frame + mark if self.pending or mark else frame, final=False)
                self.pending = b""
            return
        if piece.stop_string is not None and self.request is not None:
            self.request.close()  # the abort reaches the engine before the client sees the end
        self._write(self.pending + (frame or b"") + b"".join(self.encoder.finish(self.generation, piece))
                    + self.cutter.mark(), final=True)

    def fail(self, error: ApiError) -> None:
        try:
            frames = b"".join(self.encoder.error(error))
        except Exception as encode_exc:  # nothing more can be told: end the stream
            logger.error("stream error event failed", exc_info=encode_exc)
            frames = b""
        self._write(self.pending + frames + self.cutter.mark(error.status), final=True)

    def _write(self, data: bytes, final: bool) -> None:
        self.final = final
        if self.suspended is None:
            try:
                if not final and self.direct is not None and self.direct.write(data):
                    return
                self.suspended = _step(self.send, {"type": "http.response.body", "body": data,
                                                   "more_body": not final})
            except Exception as exc:  # the connection failed under the write: nothing to tell
                logger.debug("stream write failed", exc_info=exc)
                self.final = True
        else:
            self.held.append(data)
        if (self.final or self.suspended is not None) and not self.wake.done():
            self.wake.set_result(None)
