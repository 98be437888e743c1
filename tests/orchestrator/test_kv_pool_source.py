"""Where the KV pool fetches a prompt's prefix from, and when it is worth it (``orchestrator.kv_pool``)."""

from __future__ import annotations

import pytest

from common.block_hash import compute_block_hashes
from orchestrator.config import KVPoolConfig
from orchestrator.kv_pool import KVPool, worth_fetching
from orchestrator.prompt import ParsedRequest
from orchestrator.registry import WorkerRecord
from orchestrator.view import ClusterView
from workers.disagg_params import DisaggParams, RequestType

PROMPT = list(range(100, 260))  # 160 tokens: 10 blocks of 16, the last one never fetched (its last token)
HASHES = list(compute_block_hashes(PROMPT, 16, 0))
ON = KVPoolConfig(enabled=True, min_blocks=2, overhead_seconds=0.0)


def view_of(held: dict[str, int], roles: dict[str, str] | None = None) -> ClusterView:
    """Workers w0.. holding the prompt's first ``held[w]`` blocks."""
    view = ClusterView(0, 16, 0)
    for worker_id in held:
        role = (roles or {}).get(worker_id, "ctx")
        view.workers[worker_id] = WorkerRecord(worker_id=worker_id, role=role, url=f"http://{worker_id}",
                                               static=True, kv_endpoint=f"tcp://{worker_id}:1", healthy=True)
    view.kv.replace({worker_id: HASHES[:blocks] for worker_id, blocks in held.items()})
    return view


def request() -> ParsedRequest:
    return ParsedRequest("completions", {"model": "m"}, PROMPT, False, None, 4)


def test_the_worker_holding_the_most_leading_blocks_is_the_source():
    view = view_of({"w0": 0, "w1": 4, "w2": 7}, roles={"w2": "gen"})
    source = KVPool(view, None).source(ON, request(), view.workers["w0"])  # type: ignore[arg-type]
    assert source is not None and source.holder.worker_id == "w2"  # a gen worker is a holder too
    assert (source.num_tokens, source.gain_tokens) == (7 * 16, 7 * 16)


def test_no_fetch_when_disabled_when_the_gain_is_small_or_for_the_last_block():
    view = view_of({"w0": 3, "w1": 4})
    pool = KVPool(view, None)  # type: ignore[arg-type]
    assert pool.source(KVPoolConfig(enabled=False), request(), view.workers["w0"]) is None
    assert pool.source(ON, request(), view.workers["w0"]) is None  # 1 block more < min_blocks 2
    whole = view_of({"w0": 0, "w1": 10})
    source = KVPool(whole, None).source(ON, request(), whole.workers["w0"])  # type: ignore[arg-type]
    assert source is not None and source.num_tokens == 9 * 16  # the ctx worker computes the last token


def test_a_holder_that_hashes_otherwise_or_is_unhealthy_is_no_source():
    view = view_of({"w0": 0, "w1": 8, "w2": 8})
    view.workers["w1"].block_size = 32
    view.workers["w2"].healthy = False
    assert KVPool(view, None).source(ON, request(), view.workers["w0"]) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("gain, prefill, transfer, overhead, fetch", [
    (1024, 0.0, 0.0, 0.01, True),  # nothing measured yet: fetch, and measure
    (1024, 2000.0, 100_000.0, 0.01, True),  # 0.51 s of prefill against 0.02 s
    (64, 20_000.0, 100_000.0, 0.01, False),  # 3.2 ms of prefill against 10.6 ms
    (1024, 2000.0, 1000.0, 0.0, False),  # a transfer path slower than prefill
])
def test_worth_fetching_compares_prefill_with_overhead_plus_transfer(gain, prefill, transfer, overhead, fetch):
    assert worth_fetching(gain, overhead, prefill, transfer) is fetch


def answer(**fields) -> DisaggParams:
    """A ctx answer's params (those the cost model reads)."""
    return DisaggParams(RequestType.CONTEXT_ONLY, **fields)


def test_the_speeds_are_measured_from_the_ctx_answers():
    view = view_of({"w0": 0})
    pool = KVPool(view, None)  # type: ignore[arg-type]
    worker = view.workers["w0"]
    pool.observe_ctx_leg(worker, 1000, answer(num_cached_tokens=200), 0.4)  # 800 computed in 0.4 s
    assert pool.measured_prefill_tps == pytest.approx(2000.0)
    pool.observe_ctx_leg(worker, 1000, answer(num_cached_tokens=0), 0.25)  # 4000/s, averaged in
    assert pool.measured_prefill_tps == pytest.approx(2000.0 + 0.2 * 2000.0)
    pool.observe_ctx_leg(worker, 1000, answer(kv_pulled_blocks=50, kv_pull_seconds=0.008), 0.1)
    assert pool.measured_transfer_tps == pytest.approx(50 * 16 / 0.008)
    assert pool.measured_prefill_tps == pytest.approx(2400.0)  # a leg that pulled says nothing of prefill
    pool.observe_ctx_leg(worker, 40, answer(), 0.1)  # too few tokens to measure a speed by
    assert pool.measured_prefill_tps == pytest.approx(2400.0)


def test_blocks_in_a_lower_tier_count_for_the_holder_and_the_ctx_worker():
    view = view_of({"w0": 1, "w1": 2})
    view.kv.lower["w1"] = set(HASHES[2:8])  # pool 2 + host/disk 6: 8 leading blocks
    source = KVPool(view, None).source(ON, request(), view.workers["w0"])  # type: ignore[arg-type]
    assert source is not None and (source.holder.worker_id, source.num_tokens, source.gain_tokens) == ("w1", 128, 112)
    view.kv.lower["w0"] = set(HASHES[1:7])  # the ctx worker holds 7 itself: 1 more is below min_blocks
    assert KVPool(view, None).source(ON, request(), view.workers["w0"]) is None  # type: ignore[arg-type]
