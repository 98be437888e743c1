"""A streamed generation leg, from its first chunk to its end, relayed to the client.

``Flow.stream_gen`` hands one over once the first chunk is in (until then a
failure is retried). Two ways to drain it, with the same ends:

- ``frames()``: an async generator of SSE bytes (the ASGI routes' event
  stream); a task wakes per chunk.
- ``pipe(sink)``: push, for the fast lane (``orchestrator.fast_http``): the
  worker connection's protocol calls ``sink(data, end)`` with every read's
  bytes (the stream's end in the same call when it came in the same read),
  so relaying an event costs no task wake-up and no generator step; the
  caller awaits the end.

Either way the request's deadline is one timer that ends the upstream answer;
a worker that fails or falls silent mid-stream ends the client's stream with
the API's error event; ``close()`` (once, on every path) releases the
worker's load, closes the upstream answer (a client that left: the worker
sees the disconnect and aborts) and finishes the request's record.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, AsyncGenerator, Callable

from frontends.errors import http_error
from orchestrator.clean_ends import stream_error_frame
from orchestrator.errors import RequestTimeoutError, UpstreamFailedError
from orchestrator.http_client import LegResponse, UpstreamError, UpstreamTimeout

if TYPE_CHECKING:
    from orchestrator.flow import Flow
    from orchestrator.prompt import ParsedRequest
    from orchestrator.registry import WorkerRecord
    from orchestrator.state_protocol import RequestTrace

__all__ = ["Relay", "Sink"]

Sink = Callable[[bytes, bool], None]
"""``sink(data, end)``: SSE bytes for the client; ``end``: nothing follows them."""


class Relay:
    def __init__(self, flow: Flow, request: ParsedRequest, upstream: LegResponse, chunks: AsyncGenerator[bytes, None],
                 first_chunk: bytes, worker: WorkerRecord, tokens: int, record: RequestTrace,
                 deadline: float) -> None:
        self.flow = flow
        self.request = request
        self.upstream = upstream
        self.chunks = chunks  # the upstream body after first_chunk
        self.first_chunk = first_chunk  # a FinalFrame when the whole answer came at once
        self.worker = worker
        self.tokens = tokens
        self.record = record
        self.deadline = deadline
        self.last = first_chunk  # the last bytes relayed: an error event must start on a line of its own
        self._expiry: asyncio.TimerHandle | None = None
        self._closed = False
        self._ended = False  # the stream reached its end (or its error event): closed before, the client left

    def _start(self) -> None:
        # One timer for the request's deadline, not an asyncio.timeout per relayed event: it ends
        # the upstream answer (closing the connection aborts the request in the worker).
        self._expiry = asyncio.get_running_loop().call_later(
            max(self.deadline - time.monotonic(), 0.001), self.upstream.expire,
            UpstreamTimeout("the request timed out"))

    async def frames(self) -> AsyncGenerator[bytes, None]:
        self._start()
        try:
            yield self.first_chunk
            async for chunk in self.chunks:
                self.last = chunk
                yield chunk
            self._ended = True
        except (UpstreamError, asyncio.TimeoutError) as exc:
            self._ended = True
            yield self.error_frame(exc)
        finally:
            self.close()

    async def pipe(self, sink: Sink) -> None:
        """Relay what follows the first chunk (the caller sent that) to ``sink`` until the end;
        cancelling this closes the upstream answer."""
        await self.chunks.aclose()  # the upstream's pull reader: replaced by the push below
        self._start()
        done = asyncio.get_running_loop().create_future()

        def deliver(data: bytes, end: bool, error: UpstreamError | None) -> None:
            if self._closed:  # the client left: what the closing upstream says after that is nobody's
                return
            self._ended = end
            if data:
                self.last = data
            if error is not None:
                data += self.error_frame(error)
            sink(data, end)
            if end and not done.done():
                done.set_result(None)

        try:
            self.upstream.relay_to(deliver)
            await done
        finally:
            self.close()

    def error_frame(self, exc: BaseException) -> bytes:
        """The API's error event that ends the stream after ``exc``, counted and recorded."""
        timed_out = isinstance(exc, (asyncio.TimeoutError, UpstreamTimeout))
        error = http_error(RequestTimeoutError("the request timed out") if timed_out else
                           UpstreamFailedError(f"the generation worker failed mid-stream: {type(exc).__name__}"))
        self.record.error = error.message
        self.flow.metrics.errors.labels("gen", "timeout" if timed_out else "stream").inc()
        separator = b"" if self.last.endswith(b"\n\n") else b"\n\n"
        return separator + stream_error_frame(self.request.api == "messages", error)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._expiry is not None:
            self._expiry.cancel()
        flow = self.flow
        if not self._ended:
            flow.metrics.disconnects.labels("gen").inc()
        gen = self.record.gen  # set by the leg that answered (Flow.stream_gen)
        if gen is not None:
            gen.end = time.time()
            flow.metrics.observe("gen", gen.end - gen.start)
        flow.view.release(self.worker.worker_id, self.tokens)
        self.upstream.close()  # a client that left: the worker sees the disconnect and aborts
        flow.finish(self.record, self.request)
