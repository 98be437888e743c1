"""Arrival processes and the run loop: closed-loop concurrency sweeps and open-loop Poisson rates.

Closed loop at concurrency C: C session loops, each running one session's turns back to back
(the next turn is sent when the previous answer is complete, as an agent does), then the next
session. Open loop at rate R: sessions start at Poisson arrivals of R per second (exponential
gaps); each runs its turns back to back, so for single-turn sessions R is the request rate.
A level ends when ``num_requests`` have been sent or ``duration`` has passed, whichever comes
first, and its in-flight requests have finished. Warm-up requests run before the first level and
are not recorded.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from disagg.bench.api_clients import ApiClient
from disagg.bench.metrics import RequestRecord, RunSummary, summarize
from disagg.bench.sender import send_request
from disagg.bench.text import TextSource, measure_tokens_per_word
from disagg.bench.workload import Message, Workload, WorkloadConfig

__all__ = ["BenchPlan", "LevelResult", "Progress", "run_bench"]


@dataclass(frozen=True)
class BenchPlan:
    url: str
    api: ApiClient
    workload: WorkloadConfig
    concurrencies: tuple[int, ...] = ()
    rates: tuple[float, ...] = ()
    num_requests: int | None = 100
    duration: float | None = None
    warmup: int = 0
    timeout: float = 600.0
    slo: dict[str, float] = field(default_factory=dict)


@dataclass
class LevelResult:
    summary: RunSummary
    records: list[RequestRecord]


class Progress(Protocol):
    def start_level(self, label: str, total: int | None, duration: float | None) -> None: ...
    def request_done(self, record: RequestRecord) -> None: ...
    def end_level(self, summary: RunSummary) -> None: ...


class _Budget:
    """Shared by a level's session loops: may another request start?"""

    def __init__(self, num_requests: int | None, duration: float | None) -> None:
        self.left = num_requests
        self.deadline = time.perf_counter() + duration if duration else None

    def take(self) -> bool:
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return False
        if self.left is not None:
            if self.left <= 0:
                return False
            self.left -= 1
        return True


class _Level:
    def __init__(self, plan: BenchPlan, client: httpx.AsyncClient, workload: Workload, budget: _Budget,
                 progress: Progress | None) -> None:
        self.plan, self.client, self.workload, self.budget, self.progress = plan, client, workload, budget, progress
        self.records: list[RequestRecord] = []
        self.start = time.perf_counter()

    async def session(self) -> bool:
        """One session's turns; False when the budget ran out before its first turn."""
        plan = self.workload.next_session()
        rng = self.workload.session_rng(plan)
        conversation = self.workload.start()
        for index, turn in enumerate(plan.turns):
            if not self.budget.take():
                return index > 0
            self.workload.add_turn(conversation, plan, index, rng)
            record = RequestRecord(plan.session_id, index, 0.0)
            body = self.plan.api.body(conversation, turn.max_tokens)
            text = await send_request(self.client, self.plan.api, self.plan.url, body, record, self.start)
            self.records.append(record)
            if self.progress:
                self.progress.request_done(record)
            if not record.ok:
                break  # an agent whose turn failed does not go on with a broken history
            conversation.messages.append(Message("assistant", text))
        return True

    async def closed_loop(self, concurrency: int) -> None:
        async def loop() -> None:
            while await self.session():
                pass
        await asyncio.gather(*(loop() for _ in range(concurrency)))

    async def open_loop(self, rate: float, rng: random.Random) -> None:
        tasks: list[asyncio.Task] = []
        while self.budget.left is None or self.budget.left > 0:
            if self.budget.deadline is not None and time.perf_counter() >= self.budget.deadline:
                break
            tasks.append(asyncio.ensure_future(self.session()))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)


async def _calibrated_text(client: httpx.AsyncClient, plan: BenchPlan) -> TextSource:
    measured = await measure_tokens_per_word(client, plan.url, plan.api.model)
    return TextSource(measured) if measured else TextSource()


async def run_bench(plan: BenchPlan, progress: Progress | None = None) -> tuple[list[LevelResult], TextSource]:
    """Every level of the plan, in order (concurrencies, then rates); returns their results and the
    text source (its ``tokens_per_word`` says whether the deployment's tokenizer was reached)."""
    levels = [("concurrency", float(c)) for c in plan.concurrencies] + [("rate", r) for r in plan.rates]
    top = max([*plan.concurrencies, 1]) + 64  # open-loop levels may hold more sessions in flight
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=top)
    timeout = httpx.Timeout(plan.timeout, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        text = await _calibrated_text(client, plan)
        if plan.warmup:
            warm = _Level(plan, client, Workload(plan.workload, text, stream=0), _Budget(plan.warmup, None), None)
            await warm.closed_loop(min(plan.warmup, max([*plan.concurrencies, 1])))
        results = []
        for index, (mode, level) in enumerate(levels, start=1):
            run = _Level(plan, client, Workload(plan.workload, text, stream=index),
                         _Budget(plan.num_requests, plan.duration), progress)
            if progress:
                progress.start_level(f"{mode} {level:g}", plan.num_requests, plan.duration)
            if mode == "concurrency":
                await run.closed_loop(int(level))
            else:
                await run.open_loop(level, random.Random(plan.workload.seed + index))
            duration = time.perf_counter() - run.start
            summary = summarize(run.records, mode, level, duration, plan.slo)
            if progress:
                progress.end_level(summary)
            results.append(LevelResult(summary, run.records))
    return results, text
