"""One worker's engine in simulated time: the real ``EngineCore`` (scheduler, block manager, prefix
cache, KV events) on the synthetic executor, whose steps take the timing model's seconds of the
simulation's clock instead of sleeping them.

A step runs at once (``EngineCore.step``: schedule, execute, update) and its outputs are delivered
when its simulated duration has passed; requests that arrive meanwhile join the next step, as they
do in the real engine loop. KV pulls a gen engine publishes are handed to the cluster, which fills
them from the ctx engine's parked blocks after the transfer's simulated time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from workers.config import EngineConfig, SyntheticConfig
from workers.engine.core import EngineCore
from workers.engine.executor import ExecutorOutput, SchedulerOutput
from workers.engine.scheduler import KVPull
from workers.engine.synthetic import SyntheticExecutor, step_seconds
from workers.protocol import RequestOutput

__all__ = ["SimEngine"]


class _ClockedExecutor(SyntheticExecutor):
    """The synthetic executor with no sleep: it notes what each step would have cost."""

    def __init__(self, config: EngineConfig, timing: SyntheticConfig) -> None:
        super().__init__(dataclasses.replace(config, synthetic=dataclasses.replace(
            timing, prefill_seconds_per_token=0.0, decode_step_base_seconds=0.0, decode_seconds_per_seq=0.0)))
        self.sim_timing = timing
        self.last_step_seconds = 0.0

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        self.last_step_seconds = step_seconds(self.sim_timing, batch)
        return super().execute(batch)


class SimEngine:
    """``schedule(at, callback)`` is the simulation's event queue; ``on_outputs`` and ``on_pulls``
    receive what each step produced, at the simulated time it is done."""

    def __init__(self, worker_id: str, config: EngineConfig,
                 schedule: Callable[[float, Callable[[float], None]], None],
                 on_outputs: Callable[[float, SimEngine, list[RequestOutput]], None],
                 on_pulls: Callable[[float, SimEngine, list[KVPull]], None]) -> None:
        self.worker_id = worker_id
        self.executor = _ClockedExecutor(config, config.synthetic)
        self.core = EngineCore(config, self.executor, inline_onboarding=True)  # the timing model charges it
        self.schedule, self.on_outputs, self.on_pulls = schedule, on_outputs, on_pulls
        self.busy = False
        self.busy_seconds = 0.0

    def kick(self, now: float) -> None:
        """Start a step now unless one is running (it starts the next itself) or there is no work."""
        if self.busy:
            return
        if not (self.core.has_work() or self.core.has_kv_pulls()):
            return
        self.executor.last_step_seconds = 0.0
        outputs = self.core.step()
        pulls = self.core.take_kv_pulls()
        seconds = self.executor.last_step_seconds
        if pulls:
            self.on_pulls(now, self, pulls)
        if seconds <= 0.0:  # nothing computed (blocks allocated for pulls, rejections): no time passes
            if outputs:
                self.on_outputs(now, self, outputs)
            if self.core.has_work() and (outputs or pulls):
                self.kick(now)
            return
        self.busy = True
        self.busy_seconds += seconds

        def done(at: float) -> None:
            self.busy = False
            if outputs:
                self.on_outputs(at, self, outputs)
            self.kick(at)

        self.schedule(now + seconds, done)
