"""``disagg bench URL --trace FILE``: replay a Mooncake-format trace against an OpenAI-compatible server.

Each request of the window is sent at its own arrival time (open loop: times from the trace, scaled
by ``time_scale``; a slow answer never delays the next arrival) to ``/v1/completions`` with its
prompt as token ids (``trace.TokenMap``), ``max_tokens`` = its output length (capped by
``max_output_tokens`` when set) and ``ignore_eos``, streamed with usage. The level's summary is
``metrics.summarize``'s, mode ``trace``; the cached fraction of prompt tokens it reports (from the
usage's cached tokens) is printed next to the window's ceiling (``trace.prefix_ceiling``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from disagg.bench.api_clients import OpenAICompletions
from disagg.bench.metrics import RequestRecord, summarize
from disagg.bench.report import FORMAT
from disagg.bench.runner import LevelResult, Progress
from disagg.bench.sender import send_request
from disagg.bench.trace import Ceiling, TokenMap, TraceRequest, TraceWindow, prefix_ceiling

__all__ = ["TracePlan", "replay_trace", "trace_result", "trace_lines"]


@dataclass(frozen=True)
class TracePlan:
    url: str
    api: OpenAICompletions
    path: Path
    window: TraceWindow
    requests: list[TraceRequest]
    token_map: TokenMap
    time_scale: float = 1.0
    """Trace time × this = replay time: 2 replays at half the trace's rate, 0.5 at twice it."""
    max_output_tokens: int | None = None
    timeout: float = 600.0
    slo: dict[str, float] | None = None

    @property
    def ceiling(self) -> Ceiling:
        return prefix_ceiling(self.requests, self.token_map)

    def max_tokens(self, request: TraceRequest) -> int:
        if self.max_output_tokens is None:
            return request.output_length
        return min(request.output_length, self.max_output_tokens)


async def replay_trace(plan: TracePlan, progress: Progress | None = None) -> LevelResult:
    """Every request of the plan at its time; the level's records and summary."""
    blocks: dict[int, list[int]] = {}  # each hash id's tokens, made once
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    records: list[RequestRecord] = []
    if progress:
        progress.start_level(f"trace x{plan.time_scale:g}", len(plan.requests), None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(plan.timeout, connect=10.0)) as client:
        start = time.perf_counter()

        async def one(index: int, request: TraceRequest) -> None:
            delay = start + request.timestamp / 1e3 * plan.time_scale - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            # Made at send time, not ahead: a window's prompts together would hold ~12k ids per request.
            body = plan.api.prompt_body(plan.token_map.prompt(request, blocks), plan.max_tokens(request))
            record = RequestRecord(index, 0, 0.0)
            await send_request(client, plan.api, plan.url, body, record, start)
            records.append(record)
            if progress:
                progress.request_done(record)

        await asyncio.gather(*(one(i, r) for i, r in enumerate(plan.requests)))
        duration = time.perf_counter() - start
    records.sort(key=lambda r: r.session_id)
    summary = summarize(records, "trace", plan.time_scale, duration, plan.slo or {})
    if progress:
        progress.end_level(summary)
    return LevelResult(summary, records)


def trace_result(plan: TracePlan, level: LevelResult) -> dict[str, Any]:
    """The results file of a replay (``report.FORMAT``, so ``compare`` and the plots read it): one run of
    mode ``trace``, and under ``trace`` what was replayed and the cache against the window's ceiling."""
    ceiling = plan.ceiling
    measured = level.summary.cached_fraction
    trace = {"file": str(plan.path), "window": str(plan.window), "time_scale": plan.time_scale,
             "requests": len(plan.requests), "block_tokens": plan.token_map.block_tokens,
             "trace_block_tokens": plan.token_map.trace_block, "max_output_tokens": plan.max_output_tokens,
             "ceiling_blocks": ceiling.blocks, "ceiling_tokens": ceiling.tokens, "cached_fraction": measured,
             "cached_of_ceiling": None if measured is None or not ceiling.tokens else measured / ceiling.tokens}
    return {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "url": plan.url,
            "api": plan.api.name, "model": plan.api.model, "workload": {"trace": trace["file"]},
            "num_requests": len(plan.requests), "duration": None, "warmup": 0, "tokens_per_word": None,
            "tokenizer": "token ids", "slo": plan.slo or {}, "trace": trace,
            "runs": [{**level.summary.to_dict(), "records": [dataclasses.asdict(r) for r in level.records]}]}


def trace_lines(result: dict[str, Any]) -> list[str]:
    """The cache line printed under the run's figures."""
    trace = result["trace"]
    measured = trace["cached_fraction"]
    if measured is None:
        return [f"  cache   the server reported no cached tokens; ceiling of the window {trace['ceiling_tokens']:.3f}"]
    of = trace["cached_of_ceiling"]
    return [f"  cache   cached fraction of prompt tokens {measured:.3f}, ceiling of the window "
            f"{trace['ceiling_tokens']:.3f} ({trace['ceiling_blocks']:.3f} of blocks): "
            f"{'-' if of is None else f'{of:.2f}'} of the ceiling"]
