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
a worker that fails or falls silent mid-stream has its stream moved to another
gen worker (``orchestrator.migration``, when ``migration.limit`` > 0: then only
whole writes are relayed, their marks stripped), or, when it cannot move, ends
the client's stream with the API's error event; ``close()`` (once, on every
path) releases the worker's load, closes the upstream answer (a client that
left: the worker sees the disconnect and aborts) and finishes the request's record.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING

from api.errors import http_error
from orchestrator.clean_ends import stream_error_frame
from orchestrator.errors import RequestTimeoutError, UpstreamFailedError
from orchestrator.http_client import LegResponse, UpstreamError, UpstreamTimeout
from orchestrator.state_protocol import FailedLeg
from workers.http_protocol import Phase

if TYPE_CHECKING:
    from orchestrator.flow import Flow
    from orchestrator.migration import Migration
    from orchestrator.prompt import ParsedRequest
    from orchestrator.registry import WorkerRecord
    from orchestrator.state_protocol import RequestTrace

__all__ = ["Relay", "Sink"]

Sink = Callable[[bytes, bool], None]
"""``sink(data, end)``: SSE bytes for the client; ``end``: nothing follows them."""


class Relay:
    def __init__(self, flow: Flow, request: ParsedRequest, upstream: LegResponse, chunks: AsyncGenerator[bytes, None],
                 first_chunk: bytes, worker: WorkerRecord, tokens: int, record: RequestTrace,
                 deadline: float, migration: Migration | None = None) -> None:
        self.flow = flow
        self.migration = migration  # None: relayed as it comes, a failure ends the stream
        self.request = request
        self.upstream = upstream
        self.chunks = chunks  # the upstream body after first_chunk
        self.first_chunk = first_chunk  # a FinalFrame when the whole answer came at once
        self.worker = worker
        self.tokens = tokens
        self.record = record
        self.deadline = deadline
        self.last = first_chunk  # the last bytes relayed: an error event must start on a line of its own
        self.previous = b""  # the bytes before ``last``: with it, where the answer's usage is (the access log)
        self._expiry: asyncio.TimerHandle | None = None
        self._expired = False  # the deadline's timer fired: the request's own end, not the worker's failure
        self._closed = False
        self._holding = True  # the current worker's load is ours to release
        self._ended = False  # the stream reached its end (or its error event): closed before, the client left

    def _start(self) -> None:
        # One timer for the request's deadline, not an asyncio.timeout per relayed event: it ends
        # the upstream answer (closing the connection aborts the request in the worker).
        # The upstream read when it fires: after a migration, the resumed leg's.
        self._expiry = asyncio.get_running_loop().call_later(max(self.deadline - time.monotonic(), 0.001),
                                                             self._expire)

    def _expire(self) -> None:
        # Remembered, not read off the clock later: uvloop's timers run up to a millisecond before
        # time.monotonic() reaches the deadline, and a cut taken for a worker's failure migrated the
        # stream and made the worker suspect (a request past its deadline blamed a healthy worker).
        self._expired = True
        self.upstream.expire(UpstreamTimeout("the request timed out"))

    async def frames(self) -> AsyncGenerator[bytes, None]:
        self._start()
        try:
            yield self.first_chunk
            migration = self.migration
            while True:
                failure: BaseException | str | None = None if migration is None else migration.take_failure()
                if failure is None:
                    try:
                        async for chunk in self.chunks:
                            if migration is not None:
                                chunk = migration.read(chunk)
                            if chunk:
                                self.previous, self.last = self.last, chunk
                                yield chunk
                            if migration is not None and migration.failed is not None:
                                break
                        else:
                            rest = b"" if migration is None else migration.rest()
                            if rest:
                                self.previous, self.last = self.last, rest
                                yield rest
                            self._ended = True
                            return
                        failure = migration.take_failure()
                    except (TimeoutError, UpstreamError) as exc:
                        failure = exc
                assert failure is not None
                if not await self._migrate(failure):
                    self._ended = True
                    yield self.error_frame(failure)
                    return
                self.chunks = self.upstream.chunks()
        finally:
            self.close()

    async def pipe(self, sink: Sink) -> None:
        """Relay what follows the first chunk (the caller sent that) to ``sink`` until the end;
        cancelling this closes the upstream answer."""
        await self.chunks.aclose()  # the upstream's pull reader: replaced by the push below
        self._start()
        try:
            while True:
                failure: BaseException | str | None = None
                if self.migration is not None:
                    failure = self.migration.take_failure()
                if failure is None:
                    failure = await self._push(sink)
                if failure is None:
                    return
                if not await self._migrate(failure):
                    self._ended = True
                    sink(self.error_frame(failure), True)
                    return
        finally:
            self.close()

    async def _push(self, sink: Sink) -> BaseException | str | None:
        """Relay the current upstream answer to ``sink`` until its end (None) or a failure that a
        migration may mend (returned, nothing written for it)."""
        done: asyncio.Future[BaseException | str | None] = asyncio.get_running_loop().create_future()
        upstream, migration = self.upstream, self.migration

        def deliver(data: bytes, end: bool, error: UpstreamError | None) -> None:
            # The client left (closed), or this answer failed and is being replaced: nobody's.
            if self._closed or done.done():
                return
            failed = None
            if migration is not None:
                data = migration.read(data)
                failed = migration.take_failure()
                if end and failed is None and error is None:
                    data += migration.rest()
            if failed is not None or (error is not None and migration is not None):
                if data:
                    self.previous, self.last = self.last, data
                    sink(data, False)
                upstream.close()
                done.set_result(failed if failed is not None else error)
                return
            self._ended = end
            if data:
                self.previous, self.last = self.last, data
            if error is not None:
                data += self.error_frame(error)
            sink(data, end)
            if end:
                done.set_result(None)

        upstream.relay_to(deliver)
        return await done

    async def _migrate(self, failure: BaseException | str) -> bool:
        """Move the stream to another gen worker (``orchestrator.migration``); False: it cannot."""
        migration = self.migration
        if migration is None:
            return False
        why = failure if isinstance(failure, str) else f"{type(failure).__name__}: {failure}"
        failed = self.worker
        self._release()
        moved = await migration.move(failed, why, self._expired or time.monotonic() >= self.deadline)
        if moved is None:
            return False
        self.record.legs.append(FailedLeg(Phase.GEN, failed.worker_id, why))
        self.worker, self.upstream = moved
        self.flow.view.acquire(self.worker.worker_id, self.tokens)
        self._holding = True
        self.record.retries += 1
        if self.record.gen is not None:
            self.record.gen.worker_id = self.worker.worker_id
        if self._expired or time.monotonic() >= self.deadline:  # the deadline's timer fired during the move
            self._expire()
        return True

    def _release(self) -> None:
        """Give back the current worker's load and answer (once per worker)."""
        if self._holding:
            self._holding = False
            self.flow.view.release(self.worker.worker_id, self.tokens)
        self.upstream.close()

    def error_frame(self, exc: BaseException | str) -> bytes:
        """The API's error event that ends the stream after ``exc`` (a str: the worker's own error
        event, which a marked stream does not relay), counted and recorded."""
        timed_out = isinstance(exc, (asyncio.TimeoutError, UpstreamTimeout))
        name = exc.split(",")[0] if isinstance(exc, str) else type(exc).__name__
        error = http_error(RequestTimeoutError("the request timed out") if timed_out else
                           UpstreamFailedError(f"the generation worker failed mid-stream: {name}"))
        self.record.error = error.message
        self.flow.metrics.errors.labels(Phase.GEN, "timeout" if timed_out else "stream").inc()
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
            flow.metrics.disconnects.labels(Phase.GEN).inc()
        gen = self.record.gen  # set by the leg that answered (Flow.stream_gen)
        if gen is not None:
            gen.end = time.time()
            flow.metrics.observe(Phase.GEN, gen.end - gen.start)
        self._release()  # a client that left: the worker sees the disconnect and aborts
        flow.finish(self.record, self.request, self.previous + self.last)
