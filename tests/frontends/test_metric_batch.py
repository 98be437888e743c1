"""Batched Prometheus writes (``api.metric_batch``) and a frontend's request metrics through them."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Histogram

from api.metric_batch import MetricBatch, observe_all
from frontends.prometheus import FLUSH_SECONDS, FrontendMetrics
from workers.protocol import PerfRecord

BUCKETS = (0.005, 0.01, 0.25, 1.0)
VALUES = [0.001, 0.005, 0.0051, 0.3, 0.25, 7.0, 0.0, 1.0]  # on bounds, between them, past the last


def _samples(registry: CollectorRegistry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in registry.collect()
            for s in family.samples if not s.name.endswith("_created")}


def _pair() -> tuple[CollectorRegistry, Histogram, Counter, CollectorRegistry, Histogram, Counter]:
    out = []
    for _ in range(2):
        registry = CollectorRegistry()
        out += [registry, Histogram("h", "h", buckets=BUCKETS, registry=registry),
                Counter("c", "c", ["kind"], registry=registry)]
    return tuple(out)  # type: ignore[return-value]


def test_observe_all_writes_what_per_value_observes_would_have():
    batched, h1, _, direct, h2, _ = _pair()
    observe_all(h1, VALUES)
    for value in VALUES:
        h2.observe(value)
    assert _samples(batched) == _samples(direct)
    assert _samples(batched)[("h_bucket", (("le", "0.005"),))] == 3.0  # 0.0, 0.001 and the bound itself


def test_a_batch_writes_on_flush_or_within_its_period_in_a_loop_and_at_once_outside():
    async def run() -> None:
        batched, h1, c1, direct, h2, c2 = _pair()
        batch = MetricBatch(0.05)
        for value in VALUES:
            batch.observe(h1, value)
            batch.count(c1.labels("a"))
            batch.count(c1.labels("b"), 2.5)
            h2.observe(value)
            c2.labels("a").inc()
            c2.labels("b").inc(2.5)
        assert _samples(batched) != _samples(direct)  # counted, not written yet
        await asyncio.sleep(0.2)  # the batch's timer
        assert _samples(batched) == _samples(direct)
        batch.count(c1.labels("a"))
        batch.flush()
        assert _samples(batched)[("c_total", (("kind", "a"),))] == len(VALUES) + 1

    asyncio.run(run())
    registry, histogram, counter, *_ = _pair()
    batch = MetricBatch(60.0)
    batch.observe(histogram, 0.3)  # no running loop: nothing would flush it later
    batch.count(counter.labels("a"))
    assert _samples(registry)[("h_count", ())] == 1.0 and _samples(registry)[("c_total", (("kind", "a"),))] == 1.0


def _record(reason: str | None, num_output_tokens: int, first_token: float | None = 10.2,
            kv: bool = False) -> PerfRecord:
    return PerfRecord(request_id=1, frontend_id=0, frontend_arrival=10.0, tokenized=10.001, engine_arrival=10.002,
                      first_scheduled=10.004, first_token=first_token, last_token=11.0, finished=11.0,
                      num_prompt_tokens=7, num_output_tokens=num_output_tokens, num_cached_tokens=3,
                      finish_reason=reason, kv_transfer_seconds=0.02 if kv else None,
                      kv_transfer_bytes=4096 if kv else 0, kv_transfer_blocks=2 if kv else 0,
                      kv_transfer_bytes_per_second=204800.0 if kv else None)


def test_a_frontends_request_metrics_are_exact_once_flushed():
    async def run() -> None:
        metrics = FrontendMetrics()
        for record in (_record("stop", 5), _record("length", 1), _record("abort", 2), _record(None, 0, None),
                       _record("length", 9, kv=True)):
            metrics.observe(record)
        assert _samples(metrics.registry)[("disagg_request_success_total", (("finished_reason", "stop"),))] == 0
        assert b"disagg_generation_tokens_total 17.0" in metrics.render()  # a render flushes first
        got = _samples(metrics.registry)
        assert got[("disagg_request_success_total", (("finished_reason", "stop"),))] == 1
        assert got[("disagg_request_success_total", (("finished_reason", "length"),))] == 2
        assert got[("disagg_request_failure_total", (("reason", "abort"),))] == 1
        assert got[("disagg_request_failure_total", (("reason", "incomplete"),))] == 1
        assert (got[("disagg_prompt_tokens_total", ())], got[("disagg_prompt_cached_tokens_total", ())]) == (35, 15)
        assert got[("disagg_e2e_request_latency_seconds_count", ())] == 5
        assert got[("disagg_time_to_first_token_seconds_count", ())] == 4  # one never had a token
        assert got[("disagg_time_to_first_token_seconds_bucket", (("le", "0.1"),))] == 0
        assert got[("disagg_time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 4
        assert got[("disagg_inter_token_latency_seconds_count", ())] == 3  # more than one token
        assert abs(got[("disagg_inter_token_latency_seconds_sum", ())] - (0.8 / 4 + 0.8 / 1 + 0.8 / 8)) < 1e-9
        assert got[("disagg_request_queue_time_seconds_count", ())] == 5
        assert got[("disagg_kv_transfer_seconds_count", ())] == 1
        assert got[("disagg_kv_transfer_bytes_total", ())] == 4096
        assert got[("disagg_kv_transfer_bytes_per_second_count", ())] == 1
        metrics.observe(_record("stop", 2))
        await asyncio.sleep(FLUSH_SECONDS * 3)  # unflushed counts reach the registry within the period
        assert _samples(metrics.registry)[("disagg_request_success_total", (("finished_reason", "stop"),))] == 2

    asyncio.run(run())


def test_a_frontend_writes_at_once_when_its_last_request_in_flight_ends():
    """So that a lone request is in the very next scrape, whichever frontend answers it."""
    from frontends.worker_app import _observer

    class Client:
        num_in_flight = 1

    def successes(metrics: FrontendMetrics) -> float:
        return _samples(metrics.registry)[("disagg_request_success_total", (("finished_reason", "stop"),))]

    async def run() -> None:
        metrics, client = FrontendMetrics(), Client()
        observe = _observer(metrics, client)  # type: ignore[arg-type]  # only num_in_flight is read
        observe(_record("stop", 2))
        assert successes(metrics) == 0  # others in flight: batched
        client.num_in_flight = 0
        observe(_record("stop", 2))
        assert successes(metrics) == 2

    asyncio.run(run())
