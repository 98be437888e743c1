"""The engine client every frontend process uses: requests out, outputs fanned in.

As vLLM's ``AsyncLLM._run_output_handler``: ONE task reads this frontend's
lane and puts each ``RequestOutput`` on its request's ``asyncio.Queue``;
``generate()`` awaits its queue. Nobody polls the engine.

Liveness: a watchdog marks the engine dead when its process is gone or its
lane has been silent for ``ENGINE_SILENCE_LIMIT`` heartbeats; then every
in-flight ``generate()`` ends with ``EngineDeadError`` (never a hang), new
ones fail at once and ``is_healthy`` is False.

Cancellation: leaving ``generate()`` before the finishing output (a stop
string, ``aclose()``, a cancelled task: a client that went away) sends an
abort for that request id. Use ``contextlib.aclosing`` to make it immediate.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import AsyncIterator

import zmq
import zmq.asyncio

from frontends.errors import EngineDeadError
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
    RequestOutput,
)
from workers.sampling_params import SamplingParams

__all__ = ["EngineClient", "EngineDeadError"]

log = logging.getLogger("disagg.engine_client")

WATCH_SECONDS = 0.5


class EngineClient:
    def __init__(self, attach: AttachInfo, frontend_id: int | None = None) -> None:
        self.attach = attach
        self.frontend_id = attach.frontend_id if frontend_id is None else frontend_id
        self.max_model_len = attach.engine.max_model_len
        self.vocab_size = attach.engine.vocab_size
        self.eos_token_ids = tuple(attach.engine.eos_token_ids)
        self._ids = ClientIdAllocator(self.frontend_id)
        key = attach.key
        self._ingress_codec: FrameCodec = FrameCodec(key, IngressMessage, f"frontend {self.frontend_id} ingress")
        self._lane_codec: FrameCodec = FrameCodec(key, OutputBatch, f"frontend {self.frontend_id} lane")
        self._queues: dict[int, asyncio.Queue[RequestOutput | EngineDeadError]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task] = []
        self._started = False
        self._last_heard = 0.0
        self.dead_reason: str | None = None
        self._dead_event: asyncio.Event | None = None

    @classmethod
    def from_attach(cls, attach: AttachInfo) -> "EngineClient":
        return cls(attach, attach.frontend_id)

    @property
    def is_healthy(self) -> bool:
        return self._started and self.dead_reason is None

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    @property
    def num_rejected_frames(self) -> int:
        return self._lane_codec.num_rejected

    async def start(self, timeout: float = 30.0) -> None:
        """Bind the lane, connect to the engine and wait for its answer to our hello."""
        paths = self.attach.paths
        self._dead_event = asyncio.Event()
        self._ctx = zmq.asyncio.Context()
        self._lane = self._ctx.socket(zmq.PULL)
        self._lane.setsockopt(zmq.LINGER, 0)
        self._lane.bind(paths.lane(self.frontend_id))
        # A plain (blocking-API) socket used only with NOBLOCK: sends complete at
        # once, even from a finally block or a generator finalizer.
        self._ingress = self._ctx.socket(zmq.PUSH, socket_class=zmq.Socket)
        configure_frontend_push(self._ingress)
        self._ingress.connect(paths.ingress)
        send_nowait(self._ingress, self._ingress_codec, FrontendHello(self.frontend_id))
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not process_alive(self.attach.engine_pid):
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
        if self._ctx is None:
            return
        self._lane.close(linger=0)
        # Give queued aborts a moment to reach a live engine; none to a dead one.
        self._ingress.close(linger=0 if self.dead_reason else 200)
        self._ctx.term()
        self._ctx = None

    async def wait_until_dead(self) -> str:
        """Wait until the engine is marked dead; the reason."""
        assert self._dead_event is not None, "start() first"
        await self._dead_event.wait()
        return self.dead_reason or ""

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs in order; stops after the one with a finish reason."""
        if not self.is_healthy:
            raise EngineDeadError(self._dead_message())
        request_id = self._ids.next_id()
        queue: asyncio.Queue[RequestOutput | EngineDeadError] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            request = EngineRequest(request_id, list(prompt_token_ids), params,
                                    time.time() if arrival_time is None else arrival_time)
            if not send_nowait(self._ingress, self._ingress_codec, AddRequest(request)):
                raise EngineDeadError("the engine is not accepting requests (its input queue is full)")
            while True:
                item = await queue.get()
                if isinstance(item, EngineDeadError):
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            del self._queues[request_id]
            if not finished and self.dead_reason is None:
                send_nowait(self._ingress, self._ingress_codec, AbortRequests([request_id]))

    async def abort(self, request_id: int) -> None:
        """Abort a request; its generate() then ends with a finish reason ``abort``."""
        if self.dead_reason is None:
            send_nowait(self._ingress, self._ingress_codec, AbortRequests([request_id]))

    async def _run_output_handler(self) -> None:
        try:
            while True:
                batch = self._lane_codec.decode(await self._lane.recv_multipart())
                if batch is None:
                    continue
                self._last_heard = time.monotonic()
                for output in batch.outputs:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:  # None: the caller already left (an abort is on its way)
                        queue.put_nowait(output)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("engine output handler failed")
            self._mark_dead(f"the engine output handler failed: {exc}")

    async def _watch_engine(self) -> None:
        silence_limit = ENGINE_SILENCE_LIMIT * HEARTBEAT_SECONDS
        while self.dead_reason is None:
            await asyncio.sleep(WATCH_SECONDS)
            silent_for = time.monotonic() - self._last_heard
            if not process_alive(self.attach.engine_pid):
                self._mark_dead(f"the engine process (pid {self.attach.engine_pid}) exited")
            elif silent_for > silence_limit:
                self._mark_dead(f"no heartbeat from the engine for {silent_for:.1f} s")

    def _mark_dead(self, reason: str, expected: bool = False) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        if not expected or self._queues:
            log.error("engine marked dead: %s; failing %d in-flight requests", reason, len(self._queues))
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(self._dead_message()))
        if self._dead_event is not None:
            self._dead_event.set()

    def _dead_message(self) -> str:
        if not self._started and self.dead_reason is None:
            return "the engine client is not started"
        return f"the engine is not available: {self.dead_reason}"


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, killed but not yet reaped, counts as gone)."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        state = stat.read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except OSError:  # no procfs (macOS): fall back to a signal-0 probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X")
