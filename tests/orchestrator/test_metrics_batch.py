"""The orchestrator's batched metric writes (``orchestrator.metrics``): what the request path counts
in memory reaches the registry, once flushed, exactly as per-value writes would have."""

from __future__ import annotations

import asyncio

from api.piece_cache import PieceCache
from orchestrator.metrics import FLUSH_SECONDS, Metrics

VALUES = [0.001, 0.005, 0.0051, 0.3, 0.25, 7.0, 400.0, 0.0]  # bucket bounds, between them, past the last


def _samples(metrics: Metrics) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in metrics.registry.collect()
            for s in family.samples if not s.name.endswith("_created")}


def test_a_flush_writes_what_per_value_writes_would_have():
    async def run() -> None:
        batched, direct = Metrics(), Metrics()
        for value in VALUES:
            batched.observe("ttft", value)
            direct.phase("ttft").observe(value)
            batched.count_leg("gen")
            direct.leg("gen").inc()
            batched.count_served("chat", "aggregated")
            direct.served("chat", "aggregated").inc()
        assert _samples(batched) != _samples(direct)  # counted, not yet written
        batched.flush()
        assert _samples(batched) == _samples(direct)
        assert _samples(batched)[("disagg_orchestrator_phase_seconds_count", (("phase", "ttft"),))] == len(VALUES)

    asyncio.run(run())


def test_counts_are_written_within_the_flush_period_and_before_a_render():
    async def run() -> None:
        metrics = Metrics()
        metrics.count_leg("ctx")
        await asyncio.sleep(FLUSH_SECONDS * 3)
        assert _samples(metrics)[("disagg_orchestrator_legs_total", (("phase", "ctx"),))] == 1
        metrics.count_leg("ctx")
        assert b'disagg_orchestrator_legs_total{phase="ctx"} 2.0' in metrics.render()

    asyncio.run(run())


def test_the_tokenizers_piece_cache_lookups_are_exported_at_each_flush():
    async def run() -> None:
        cache = PieceCache()
        metrics = Metrics(cache)
        name = "disagg_orchestrator_prompt_piece_cache_lookups_total"
        assert _samples(metrics)[(name, (("result", "hit"),))] == 0  # created at zero
        cache.put("x" * 600, [1])
        for text in ("x" * 600, "x" * 600, "y" * 600):
            cache.get(text)
        metrics.flush()
        assert _samples(metrics)[(name, (("result", "hit"),))] == 2
        assert _samples(metrics)[(name, (("result", "miss"),))] == 1

    asyncio.run(run())
