"""The engine client every frontend process uses: requests out, outputs fanned in.

As vLLM's ``AsyncLLM._run_output_handler``: ONE task reads this frontend's
lane and hands each ``RequestOutput`` to its request's sink: the
``OutputCollector`` that ``generate()`` awaits, or, for a request opened with
``open_stream()`` (a streamed HTTP answer, ``api.push_stream``), a
callback that writes the SSE event there and then, with no task woken per
output. Nobody polls the engine.

Liveness tells slow from dead. A lane silent for ``ENGINE_SILENCE_LIMIT``
heartbeats makes the engine *unresponsive*: ``is_healthy`` is False (so
``/health`` answers 503 and routers steer away), new requests are refused,
and in-flight ones end at once with ``EngineUnresponsiveError`` (a retryable
503: the orchestrator moves a stream to another worker, ``orchestrator.migration``,
or retries the request there), never waiting for the stall to end; the next
heartbeat makes it healthy again with its KV cache intact. The engine is *dead* when its process is gone or it
has been silent for the attach info's ``engine_wedged_seconds`` (minutes):
then every in-flight ``generate()`` ends with ``EngineDeadError`` (never a
hang), and the frontend's watchdog stops serving.

Cancellation: leaving ``generate()`` before the finishing output (a stop
string, ``aclose()``, a cancelled task: a client that went away), or closing
an ``open_stream()`` handle before it, sends an abort for that request id.
Use ``contextlib.aclosing`` to make it immediate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable

import msgspec
import zmq
import zmq.asyncio

from api.admission import QueueBound, QueueTicket
from api.errors import EngineDeadError, EngineUnresponsiveError
from api.request_context import TRACEPARENT
from common.processes import pid_alive
from frontends.perf_records import build_record
from workers.attach import AttachInfo
from workers.client_ids import ClientIdAllocator
from workers.ipc import ENGINE_SILENCE_LIMIT, HEARTBEAT_SECONDS, FrameCodec, configure_frontend_push, send_nowait
from workers.protocol import (
    AbortRequests,
    AddRequest,
    EngineRequest,
    FrontendHello,
    IngressMessage,
    OutputBatch,
    PerfRecord,
    RequestOutput,
)
from workers.sampling_params import SamplingParams

__all__ = ["EngineClient", "EngineDeadError", "OutputCollector", "PushedRequest", "merge_outputs"]

log = logging.getLogger("disagg.engine_client")

WATCH_SECONDS = 0.5

# Where the lane reader puts a request's outputs: an OutputCollector's put_nowait (generate())
# or a pushed stream's callback (open_stream()).
OutputSink = Callable[["RequestOutput | EngineDeadError"], None]


class EngineClient:
    def __init__(self, attach: AttachInfo, frontend_id: int | None = None) -> None:
        self.attach = attach
        self.frontend_id = attach.frontend_id if frontend_id is None else frontend_id
        self.max_model_len = attach.engine.max_model_len
        self.vocab_size = attach.engine.vocab_size
        self.eos_token_ids = tuple(attach.engine.eos_token_ids)
        # Each respawn of a slot starts 2**40 ids further: ids of a crashed predecessor never repeat.
        self._ids = ClientIdAllocator(self.frontend_id, (attach.generation << 40) & ((1 << 48) - 1))
        key = attach.key
        self._ingress_codec: FrameCodec[IngressMessage] = FrameCodec(key, IngressMessage, f"frontend {self.frontend_id} ingress")
        self._lane_codec: FrameCodec[OutputBatch] = FrameCodec(key, OutputBatch, f"frontend {self.frontend_id} lane")
        self._queues: dict[int, OutputSink] = {}  # request id -> where its outputs go
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._last_heard = 0.0
        self._received_at = 0.0  # time.time() of the last lane message: its outputs' arrival, read once a batch
        self.dead_reason: str | None = None
        self.unresponsive_reason: str | None = None  # silent past the heartbeat limit, not yet wedged
        # Called with each request's PerfRecord when it ends (frontends.perf_records.PerfRecorder.add).
        self.on_request_done: Callable[[PerfRecord], None] | None = None
        # Called with the record and the request's incoming traceparent when it came with one and
        # tracing is on (api.tracing: the worker's spans); None: off.
        self.on_traced_request: Callable[[PerfRecord, str], None] | None = None
        # This frontend's share of the worker's bound on queued requests (``api.admission``): a
        # request is counted from its submission to its first output. Checked when it is prepared
        # (``ServingContext.check_queue``), counted here.
        self.queue = QueueBound(None, None, "this worker")

    @property
    def is_healthy(self) -> bool:
        return self._started and self.dead_reason is None and self.unresponsive_reason is None

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    @property
    def num_rejected_frames(self) -> int:
        return self._lane_codec.num_rejected

    async def start(self, timeout: float = 30.0) -> None:
        """Bind the lane, connect to the engine and wait for its answer to our hello."""
        paths = self.attach.paths
        self._ctx = zmq.asyncio.Context()
        self._lane = self._ctx.socket(zmq.PULL)
        self._lane.setsockopt(zmq.LINGER, 0)
        self._lane.bind(paths.lane(self.frontend_id))
        # A plain (blocking-API) socket used only with NOBLOCK: sends complete at
        # once, even from a finally block or a generator finalizer.
        # pyzmq documents any Socket class for socket_class; its stub admits only the context's own.
        self._ingress = self._ctx.socket(zmq.PUSH, socket_class=zmq.Socket)  # type: ignore[arg-type]  # stub
        configure_frontend_push(self._ingress)
        self._ingress.connect(paths.ingress)
        send_nowait(self._ingress, self._ingress_codec, FrontendHello(self.frontend_id))
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not pid_alive(self.attach.engine_pid):
                self._close_sockets()
                pid = self.attach.engine_pid
                why = f"within {timeout:g} s" if remaining <= 0 else f"(its process, pid {pid}, exited)"
                raise EngineDeadError(f"the engine did not answer frontend {self.frontend_id} {why}")
            if await self._lane.poll(min(remaining, WATCH_SECONDS) * 1000):
                if self._lane_codec.decode(await self._lane.recv_multipart()) is not None:
                    break
        self._last_heard = time.monotonic()
        self._started = True
        self._tasks = [
            asyncio.create_task(self._run_output_handler(), name="engine-output-handler"),
            asyncio.create_task(self._watch_engine(), name="engine-watchdog"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._started and self.dead_reason is None:
            self._mark_dead("the engine client was closed", expected=True)
        self._close_sockets()

    def _close_sockets(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is None:
            return
        try:
            self._lane.close(linger=0)
            # Give queued aborts a moment to reach a live engine; none to a dead one.
            self._ingress.close(linger=0 if self.dead_reason else 200)
        finally:
            # Never left to the garbage collector: Context.__del__ -> term() waits on open sockets.
            ctx.destroy(linger=0)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        make_message: Callable[[EngineRequest], IngressMessage] | None = None,
        x_request_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs in order; stops after the one with a finish reason.

        ``make_message``: the ingress message for the request (a disaggregated
        leg: ``AddContextRequest`` / ``AddRemoteRequest``); default ``AddRequest``.
        ``x_request_id``: the HTTP request's x-request-id, for its perf record."""
        queue = OutputCollector()
        track = self._submit(queue.put_nowait, prompt_token_ids, params, arrival_time, make_message, x_request_id)
        try:
            while True:
                item = await queue.get()  # every output that arrived since the last get, merged
                track.note(item, self._received_at)
                yield item
                if track.finished:
                    return
        finally:
            self._end(track)

    def open_stream(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        on_output: Callable[[RequestOutput | EngineDeadError], None],
        arrival_time: float | None = None,
        make_message: Callable[[EngineRequest], IngressMessage] | None = None,
        x_request_id: str | None = None,
    ) -> PushedRequest:
        """``generate()`` pushed: the lane reader calls ``on_output`` with each output as it
        arrives (then an ``EngineDeadError`` if the engine dies first), no task woken per
        output. ``on_output`` must not raise. Close the handle when done: closing it before
        the finishing output aborts the request, as leaving ``generate()`` does."""
        track: _RequestTrack
        def deliver(item: RequestOutput | EngineDeadError) -> None:
            if not isinstance(item, EngineDeadError):
                track.note(item, self._received_at)
            on_output(item)
        track = self._submit(deliver, prompt_token_ids, params, arrival_time, make_message, x_request_id)
        return PushedRequest(self, track)

    def _submit(self, sink: OutputSink, prompt_token_ids: list[int], params: SamplingParams,
                arrival_time: float | None, make_message: Callable[[EngineRequest], IngressMessage] | None,
                x_request_id: str | None) -> _RequestTrack:
        if not self.is_healthy:
            raise self.unavailable_error()
        track = _RequestTrack(self._ids.next_id(), len(prompt_token_ids), arrival_time, x_request_id)
        track.queued = self.queue.add(len(prompt_token_ids))
        self._queues[track.request_id] = sink
        try:
            request = EngineRequest(track.request_id, list(prompt_token_ids), params, track.arrival_time,
                                    x_request_id)
            message = AddRequest(request) if make_message is None else make_message(request)
            if not send_nowait(self._ingress, self._ingress_codec, message):
                raise EngineDeadError("the engine is not accepting requests (its input queue is full)")
        except BaseException:
            self._end(track)
            raise
        return track

    def _end(self, track: _RequestTrack) -> None:
        """A request's consumer is done with it: unregistered, aborted if unfinished, recorded."""
        request_id = track.request_id
        if track.queued is not None:
            track.queued.leave()
            track.queued = None
        if self._queues.pop(request_id, None) is None:
            return  # ended before
        if not track.finished and self.dead_reason is None:
            send_nowait(self._ingress, self._ingress_codec, AbortRequests([request_id]))
        if self.on_request_done is not None or self.on_traced_request is not None:
            record = track.record(self.frontend_id)
            if self.on_request_done is not None:
                self.on_request_done(record)
            if track.traceparent is not None and self.on_traced_request is not None:
                self.on_traced_request(record, track.traceparent)

    async def abort(self, request_id: int) -> None:
        """Abort a request; its generate() then ends with a finish reason ``abort``."""
        if self.dead_reason is None:
            send_nowait(self._ingress, self._ingress_codec, AbortRequests([request_id]))

    async def _run_output_handler(self) -> None:
        # Batched reads: after each awaited message, what else the lane holds is read at once
        # through a blocking-API view of the same socket (no future and no wake-up per message).
        lane: zmq.Socket[bytes] = zmq.Socket.shadow(self._lane.underlying)
        try:
            while True:
                self._deliver(await self._lane.recv_multipart())
                while True:
                    try:
                        frames = lane.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._deliver(frames)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("engine output handler failed")
            self._mark_dead(f"the engine output handler failed: {exc}")

    def _deliver(self, frames: list[bytes]) -> None:
        """Each output of a lane message to its request's collector."""
        batch = self._lane_codec.decode(frames)
        if batch is None:
            return
        self._last_heard = time.monotonic()
        self._received_at = time.time()
        sinks = self._queues
        for output in batch.outputs:
            sink = sinks.get(output.request_id)
            if sink is not None:  # None: the caller already left (an abort is on its way)
                sink(output)


    async def _watch_engine(self) -> None:
        silence_limit = ENGINE_SILENCE_LIMIT * HEARTBEAT_SECONDS
        last_tick = time.monotonic()
        while self.dead_reason is None:
            await asyncio.sleep(WATCH_SECONDS)
            now = time.monotonic()
            # This process itself stalled (SIGSTOP, swapped out): the heartbeats are waiting
            # unread in the lane, so silence says nothing about the engine this round.
            stalled = now - last_tick > silence_limit / 2
            last_tick = now
            silent_for = now - self._last_heard
            if not pid_alive(self.attach.engine_pid):
                self._mark_dead(f"the engine process (pid {self.attach.engine_pid}) exited")
            elif silent_for > self.attach.engine_wedged_seconds and not stalled:
                self._mark_dead(f"no heartbeat from the engine for {silent_for:.1f} s "
                                f"(wedged: the limit is {self.attach.engine_wedged_seconds:g} s)")
            elif silent_for > silence_limit and not stalled:
                first = self.unresponsive_reason is None
                self.unresponsive_reason = f"no heartbeat from the engine for {silent_for:.1f} s"
                if first:
                    log.warning("the engine is unresponsive (no heartbeat for %.1f s): refusing new requests "
                                "until it answers; failing %d in flight", silent_for, len(self._queues))
                    self._fail_in_flight()
            elif silent_for <= silence_limit and self.unresponsive_reason is not None:
                log.info("the engine answers again (%s before)", self.unresponsive_reason)
                self.unresponsive_reason = None

    def _mark_dead(self, reason: str, expected: bool = False) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        if not expected or self._queues:
            log.error("engine marked dead: %s; failing %d in-flight requests", reason, len(self._queues))
        for sink in list(self._queues.values()):
            sink(EngineDeadError(self._dead_message()))

    def _fail_in_flight(self) -> None:
        """End every in-flight request with a retryable 503 (its abort reaches the engine when it
        reads again): a stalled engine holds no request for as long as the stall lasts."""
        error = EngineUnresponsiveError(f"the engine is not responding: {self.unresponsive_reason}")
        for sink in list(self._queues.values()):
            sink(error)

    def unavailable_error(self) -> EngineDeadError:
        """Why this client refuses new requests now (call when not ``is_healthy``)."""
        if self.dead_reason is None and self.unresponsive_reason is not None:
            return EngineUnresponsiveError(f"the engine is not responding: {self.unresponsive_reason}")
        return EngineDeadError(self._dead_message())

    def _dead_message(self) -> str:
        if not self._started and self.dead_reason is None:
            return "the engine client is not started"
        return f"the engine is not available: {self.dead_reason or self.unresponsive_reason}"


class _RequestTrack:
    """What one request's perf record needs, noted output by output."""

    __slots__ = ("request_id", "num_prompt_tokens", "arrival_time", "tokenized", "x_request_id", "traceparent",
                 "last", "last_token_time", "num_output_tokens", "num_cached_tokens", "finished", "queued")

    def __init__(self, request_id: int, num_prompt_tokens: int, arrival_time: float | None,
                 x_request_id: str | None) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.tokenized = time.time()
        self.arrival_time = self.tokenized if arrival_time is None else arrival_time
        self.x_request_id = x_request_id
        self.traceparent = TRACEPARENT.get()  # the HTTP request's, set at ingress (api.request_context)
        self.last: RequestOutput | None = None
        self.last_token_time: float | None = None
        self.num_output_tokens = 0
        self.num_cached_tokens = 0  # on the first output only (the engine's rule): the last one may say 0
        self.finished = False
        self.queued: QueueTicket | None = None  # its place in the queue bound, until its first output

    def note(self, output: RequestOutput, received_at: float) -> None:
        """``received_at``: when its lane message arrived (one clock read a batch, not one an output)."""
        if self.queued is not None:
            self.queued.leave()
            self.queued = None
        self.last = output
        if output.new_token_ids:
            self.last_token_time = received_at
            self.num_output_tokens += len(output.new_token_ids)
        if output.num_cached_tokens > self.num_cached_tokens:  # a comparison: max() is a call an output
            self.num_cached_tokens = output.num_cached_tokens
        self.finished = output.finish_reason is not None

    def record(self, frontend_id: int) -> PerfRecord:
        return build_record(self.request_id, frontend_id, self.arrival_time, self.tokenized, self.num_prompt_tokens,
                            self.num_output_tokens, self.last_token_time, self.last, self.num_cached_tokens,
                            self.x_request_id)


class PushedRequest:
    """A request whose outputs the lane reader pushes (``EngineClient.open_stream``)."""

    __slots__ = ("_client", "_track")

    def __init__(self, client: EngineClient, track: _RequestTrack) -> None:
        self._client = client
        self._track = track

    def close(self) -> None:
        """No more outputs; aborts the request in the engine unless it finished. Idempotent."""
        self._client._end(self._track)


class OutputCollector:
    """One request's outputs on their way to its ``generate()`` (vLLM's RequestOutputCollector).

    Outputs that arrive while the consumer is behind merge into one: one SSE
    frame and one socket write for all of them, so a loaded frontend spends
    less per token instead of falling further behind. An error (a dead
    engine) is raised after the outputs that came before it.
    """

    __slots__ = ("_output", "_error", "_waiter")

    def __init__(self) -> None:
        self._output: RequestOutput | None = None
        self._error: EngineDeadError | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: RequestOutput | EngineDeadError) -> None:
        if isinstance(item, EngineDeadError):
            self._error = item
        else:
            self._output = item if self._output is None else merge_outputs(self._output, item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> RequestOutput:
        while self._output is None:
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        output, self._output = self._output, None
        return output


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: tokens and logprobs joined, the
    first output's fields (``kv_transfer``) from ``earlier``, the rest from ``later``."""
    logprobs = later.new_logprobs
    if earlier.new_logprobs is not None:
        logprobs = earlier.new_logprobs + (later.new_logprobs or [])
    return msgspec.structs.replace(
        later, new_token_ids=earlier.new_token_ids + later.new_token_ids, new_logprobs=logprobs,
        num_cached_tokens=max(earlier.num_cached_tokens, later.num_cached_tokens),
        kv_transfer=earlier.kv_transfer if earlier.kv_transfer is not None else later.kv_transfer,
        prompt_logprobs=earlier.prompt_logprobs if earlier.prompt_logprobs is not None else later.prompt_logprobs)
