"""The orchestrator's KV index per worker never exceeds the worker's capacity: lost events are
detected by their ids and the set is resynchronised from the worker's snapshot.

Unit tests on ``KVIndex``, then a real worker (synthetic engine, a pool of 24 blocks) whose cache
is churned well past its capacity while the test steals some of its events (as a timed-out drain
or a second poller would).
"""

from __future__ import annotations

import httpx
import pytest
from orchestrator_process import start_orchestrator, stop_orchestrator, wait_until
from worker_process import start_worker, stop_worker

from orchestrator.kv_index import KVIndex
from workers.http_protocol import KVEventEntry, KVEventRecord


def stored(event_id: int, *hashes: int) -> KVEventEntry:
    return KVEventEntry(KVEventRecord("BlockStored", list(hashes)), event_id)


def removed(event_id: int, *hashes: int) -> KVEventEntry:
    return KVEventEntry(KVEventRecord("BlockRemoved", list(hashes)), event_id)


def test_a_gap_marks_the_worker_stale_and_a_snapshot_replaces_its_set():
    index = KVIndex()
    assert index.needs_snapshot("w")  # never synchronised
    index.adopt_snapshot("w", 0, [], num_blocks=4)
    index.apply("w", [stored(0, 1, 2, 3)])
    assert not index.needs_snapshot("w")
    index.apply("w", [stored(3, 4)])  # 1 and 2 were lost (the removal of 1, 2 among them)
    assert index.needs_snapshot("w") and index.num_gaps == 1
    # The worker's snapshot at id 6; events 4 and 5 were queued before it and are skipped.
    index.adopt_snapshot("w", 6, [3, 4, 5], num_blocks=4)
    index.apply("w", [stored(4, 9), removed(5, 3), stored(6, 6)])
    assert index.blocks["w"] == {3, 4, 5, 6} and not index.needs_snapshot("w")


def test_an_overflow_past_capacity_marks_the_worker_stale():
    index = KVIndex()
    index.adopt_snapshot("w", 0, [], num_blocks=2)
    index.apply("w", [stored(0, 1, 2), stored(1, 3)])  # no gap, yet 3 blocks in a pool of 2
    # Stale (resynchronised at the next health round) and never counted past capacity meanwhile.
    assert index.needs_snapshot("w") and index.num_overflows == 1
    assert not index.over_capacity("w") and index.blocks["w"] == set()


def test_ids_that_go_back_mean_a_restarted_worker():
    index = KVIndex()
    index.adopt_snapshot("w", 10, [1, 2], num_blocks=8)
    index.apply("w", [stored(10, 3)])
    index.apply("w", [stored(0, 7)])  # a new engine counts from 0 again
    assert index.blocks["w"] == {7}


BLOCKS = 24


@pytest.fixture(scope="module")
def small_cache(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv-bound")
    worker_url, worker = start_worker(tiny_model_dir, 1, extra_args=[
        "--num-blocks", str(BLOCKS), "--block-size", "16", "--max-num-seqs", "2"])
    url, proc = start_orchestrator(tmp, tiny_model_dir, [("both", worker_url)], processes=1,
                                   gen_router={"policy": "kv_cache_aware"}, health={"interval_seconds": 0.5})
    yield url, worker_url
    assert stop_orchestrator(proc) == 0
    stop_worker(worker)


def cached_in_orchestrator(url: str) -> int:
    return httpx.get(f"{url}/cluster_info").json()["workers"][0]["num_cached_blocks"]


def test_a_churned_cache_with_lost_events_stays_bounded_and_resynchronises(small_cache):
    url, worker_url = small_cache
    seen = []
    for i in range(30):  # 30 prompts of 3 full blocks each: the pool of 24 turns over ~4 times
        prompt = f"churn {i} " + " ".join(f"w{i}x{j}" for j in range(60))
        response = httpx.post(f"{url}/v1/completions", timeout=60,
                              json={"model": "tiny-test", "prompt": prompt, "max_tokens": 2, "ignore_eos": True})
        assert response.status_code == 200
        if i % 3 == 1:  # stolen (the orchestrator drains twice a second): it never sees these
            httpx.get(f"{worker_url}/kv_cache_events")
        seen.append(cached_in_orchestrator(url))
    assert max(seen) <= BLOCKS, seen

    def in_step() -> bool:
        truth = httpx.get(f"{worker_url}/kv_cache_snapshot").json()
        assert truth["num_blocks"] == BLOCKS and len(truth["block_hashes"]) <= BLOCKS
        mirrored = httpx.get(f"{url}/cluster_info").json()["workers"][0]["num_cached_blocks"]
        return mirrored == len(truth["block_hashes"])

    wait_until(in_step, timeout=10)  # the lost removals were repaired from the snapshot
