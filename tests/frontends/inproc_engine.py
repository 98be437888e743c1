"""A test-only engine client that runs the real EngineCore in this process.

Same duck-typed API as ``frontends.engine_client.EngineClient``
(``max_model_len``, ``vocab_size``, ``eos_token_ids``, ``is_healthy``,
``generate()``, ``abort()``), with the engine loop as one asyncio task
instead of a process: HTTP tests exercise the real scheduler and block pool
without IPC. As the real client, leaving ``generate()`` before the
finishing output aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from api.admission import QueueBound
from api.errors import EngineDeadError
from workers.config import CacheConfig, EngineConfig, SyntheticConfig
from workers.engine.core import EngineCore
from workers.engine.synthetic import SyntheticExecutor
from workers.protocol import AddResumedRequest, EngineRequest, RequestOutput
from workers.sampling_params import SamplingParams


def make_synthetic_core(
    vocab_size: int = 512,
    max_model_len: int = 256,
    eos_token_ids: frozenset[int] = frozenset(),
    num_blocks: int = 256,
    decode_step_seconds: float = 0.0,
) -> EngineCore:
    config = EngineConfig(
        kind="synthetic",
        max_model_len=max_model_len,
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        synthetic=SyntheticConfig(vocab_size=vocab_size, max_model_len=max_model_len,
                                  decode_step_base_seconds=decode_step_seconds),
    )
    return EngineCore(config, SyntheticExecutor(config, eos_token_ids=eos_token_ids))


class InprocEngineClient:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.max_model_len = core.max_model_len
        self.vocab_size = core.executor.vocab_size
        self.eos_token_ids = tuple(sorted(core.executor.eos_token_ids))
        self.healthy = True
        self.queue = QueueBound(None, None, "this test engine")
        self.num_aborts = 0
        self._ids = itertools.count(1)
        self._queues: dict[int, Callable[[RequestOutput], None]] = {}  # request id -> where its outputs go
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def is_healthy(self) -> bool:
        return self.healthy

    def unavailable_error(self) -> Exception:
        return EngineDeadError()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run_engine())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run_engine(self) -> None:
        while True:
            if not self.core.has_unfinished():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            for output in self.core.step():
                sink = self._queues.get(output.request_id)
                if sink is not None:
                    sink(output)
            await asyncio.sleep(0)  # let handlers run between steps

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float | None = None,
        make_message: object = None, x_request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if not self.healthy:
            raise EngineDeadError("the in-process engine is marked dead")
        request_id = next(self._ids)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue.put_nowait
        finished = False
        try:
            arrival = time.time() if arrival_time is None else arrival_time
            self._add(EngineRequest(request_id, list(prompt_token_ids), params, arrival), make_message)
            while True:
                output = await queue.get()
                finished = output.finish_reason is not None
                yield output
                if finished:
                    return
        finally:
            del self._queues[request_id]
            if not finished:
                await self.abort(request_id)

    def open_stream(
        self, prompt_token_ids: list[int], params: SamplingParams, on_output: Callable[[RequestOutput], None],
        arrival_time: float | None = None, make_message: object = None, x_request_id: str | None = None,
    ) -> _PushedRequest:
        """As the real client's: ``on_output`` is called from the engine task, closing aborts."""
        if not self.healthy:
            raise EngineDeadError("the in-process engine is marked dead")
        request = _PushedRequest(self, next(self._ids), on_output)
        self._queues[request.request_id] = request.deliver
        arrival = time.time() if arrival_time is None else arrival_time
        self._add(EngineRequest(request.request_id, list(prompt_token_ids), params, arrival), make_message)
        return request

    def _add(self, request: EngineRequest, make_message: Any) -> None:
        """A resumed leg's carried tokens go with it (``AddResumedRequest``); any other message's
        extras (a disaggregated leg's) are not this engine's business."""
        message = None if make_message is None else make_message(request)
        carried = message.output_token_ids if isinstance(message, AddResumedRequest) else ()
        self.core.add_request(request, output_token_ids=carried)
        self._wakeup.set()

    async def abort(self, request_id: int) -> None:
        self.num_aborts += 1
        self.core.abort(request_id)
        self._wakeup.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def wait_idle(self, timeout: float = 5.0) -> None:
        """Until the engine has no unfinished request (aborts included) and no generate() runs."""
        deadline = time.monotonic() + timeout
        while self.core.has_unfinished() or self._queues:
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not idle: {self.core.scheduler.requests}")
            await asyncio.sleep(0.01)


class _PushedRequest:
    def __init__(self, client: InprocEngineClient, request_id: int, on_output: Callable[[RequestOutput], None]) -> None:
        self.client = client
        self.request_id = request_id
        self.on_output = on_output
        self.finished = False

    def deliver(self, output: RequestOutput) -> None:
        self.finished = output.finish_reason is not None
        self.on_output(output)

    def close(self) -> None:
        if self.client._queues.pop(self.request_id, None) is not None and not self.finished:
            self.client.num_aborts += 1
            self.client.core.abort(self.request_id)
            self.client._wakeup.set()
