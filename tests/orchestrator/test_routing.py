"""Routing policies and conditional disaggregation: exact choices."""

from __future__ import annotations

import msgspec

from common.block_hash import compute_block_hashes
from orchestrator.config import ConditionalDisaggConfig, RouterConfig
from orchestrator.kv_index import KVIndex
from orchestrator.registry import WorkerRecord
from orchestrator.routing import Candidate, Router, RouteRequest, should_skip_ctx
from orchestrator.state_protocol import Snapshot
from orchestrator.view import ClusterView
from workers.http_protocol import KVEventEntry, decode_kv_events

REQ = RouteRequest(num_tokens=64)


def rows(*loads: int, matched: tuple[int, ...] = ()) -> list[Candidate]:
    matched = matched or (0,) * len(loads)
    return [Candidate(f"w{i}", load, load * 10, m) for i, (load, m) in enumerate(zip(loads, matched))]


def picks(router: Router, candidates: list[Candidate], n: int, request: RouteRequest = REQ) -> list[str]:
    return [router.choose(candidates, request).worker_id for _ in range(n)]


def test_round_robin_walks_workers_in_id_order():
    assert picks(Router(RouterConfig("round_robin")), rows(5, 0, 9), 7) == ["w0", "w1", "w2", "w0", "w1", "w2", "w0"]


def test_least_load_by_requests_and_by_tokens():
    candidates = [Candidate("w0", 3, 10), Candidate("w1", 1, 500), Candidate("w2", 2, 40)]
    assert picks(Router(RouterConfig("least_load")), candidates, 2) == ["w1", "w1"]
    assert picks(Router(RouterConfig("least_load", load_metric="tokens")), candidates, 2) == ["w0", "w0"]


def test_least_load_ties_rotate():
    assert picks(Router(RouterConfig("least_load")), rows(1, 0, 0, 0), 4) == ["w1", "w1", "w2", "w3"]


def test_kv_cache_aware_prefers_prefix_minus_load():
    router = Router(RouterConfig("kv_cache_aware", load_weight=1.0))
    assert picks(router, rows(0, 0, 0, matched=(1, 4, 2)), 2) == ["w1", "w1"]
    # w1 holds 4 blocks but runs 4 requests: 4-4=0 < w2's 2-0=2.
    assert picks(router, rows(0, 4, 0, matched=(1, 4, 2)), 1) == ["w2"]
    # Equal scores: the lower load wins.
    assert picks(router, rows(2, 0, matched=(3, 1)), 1) == ["w1"]


def test_session_is_sticky_and_moves_only_when_its_worker_leaves():
    router = Router(RouterConfig("session"))
    candidates = rows(0, 0, 0, 0)
    sessions = [f"user-{i}" for i in range(20)]
    first = {s: router.choose(candidates, RouteRequest(10, s)).worker_id for s in sessions}
    assert len(set(first.values())) > 1  # sessions spread over workers
    assert all(router.choose(candidates, RouteRequest(10, s)).worker_id == w for s, w in first.items())
    # Load does not move a session; a fresh router (another orchestrator process) agrees.
    loaded = [Candidate(c.worker_id, 50) for c in candidates]
    other = Router(RouterConfig("session"))
    assert all(other.choose(loaded, RouteRequest(10, s)).worker_id == w for s, w in first.items())
    # w1 leaves: only its sessions move.
    without = [c for c in candidates if c.worker_id != "w1"]
    for s, w in first.items():
        moved = router.choose(without, RouteRequest(10, s)).worker_id
        assert moved == w if w != "w1" else moved != "w1"


def test_session_without_id_falls_back_to_prefix_match():
    router = Router(RouterConfig("session"))
    assert picks(router, rows(0, 0, 0, matched=(0, 0, 3)), 2) == ["w2", "w2"]


def test_conditional_disaggregation_thresholds():
    config = ConditionalDisaggConfig(enabled=True, max_local_prefill_tokens=32, min_cached_fraction=0.75)
    assert should_skip_ctx(config, 30, 0, 16)  # short prompt
    assert should_skip_ctx(config, 100, 5, 16)  # 100 - 80 = 20 uncached
    assert not should_skip_ctx(config, 100, 4, 16)  # 36 uncached, 4/6 blocks < 0.75
    assert should_skip_ctx(config, 1000, 47, 16)  # 47/62 blocks >= 0.75 though 248 uncached
    assert not should_skip_ctx(config, 1000, 46, 16)  # 46/62 < 0.75
    assert not should_skip_ctx(ConditionalDisaggConfig(enabled=False), 5, 0, 16)


def entry(event: dict) -> KVEventEntry:
    """One page entry, read as the orchestrator reads a worker's page."""
    return decode_kv_events(msgspec.json.encode([event]))[0]


def stored(event_id: int, hashes: list[int]) -> KVEventEntry:
    return entry({"event_id": event_id, "timestamp": 0.0,
                  "event": {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": [],
                            "block_size": 4}})


def test_kv_index_follows_events_and_matches_chains():
    prompt = list(range(100, 124))  # 6 blocks of 4
    hashes = list(compute_block_hashes(prompt, 4, 7))
    index = KVIndex()
    assert index.apply("a", [stored(0, hashes[:4])]) == 1
    assert index.apply("b", [stored(0, hashes[:2]), stored(1, hashes[3:6])]) == 2
    assert index.num_matched_blocks("a", hashes) == 4
    assert index.num_matched_blocks("b", hashes) == 2  # a chain: block 2 is missing
    index.apply("a", [entry({"event_id": 1, "timestamp": 0.0, "event": {"type": "removed", "block_hashes": [hashes[1]]}})])
    assert index.num_matched_blocks("a", hashes) == 1
    index.apply("a", [entry({"event_id": 3, "timestamp": 0.0, "event": {"type": "AllBlocksCleared"}})])
    assert index.num_matched_blocks("a", hashes) == 0
    assert index.num_gaps == 1  # event 2 never arrived
    index.apply("b", [stored(0, hashes[:1])])  # ids start over: b restarted, its old blocks are gone
    assert index.num_matched_blocks("b", hashes) == 1 and index.blocks["b"] == {hashes[0]}


def test_view_routes_kv_aware_with_each_workers_block_size_and_seed():
    prompt = list(range(1, 41))
    view = ClusterView(0, default_block_size=16, default_hash_seed=0)
    view.apply(msgspec.convert({"version": 1, "kv_version": 1, "loads": {"1": {"w-b": [1, 0]}}, "kv": {
        "w-a": list(compute_block_hashes(prompt, 8, 3))[:2],
        "w-b": list(compute_block_hashes(prompt, 4, 0))[:9],
        "w-c": list(compute_block_hashes(prompt, 8, 0))[:5],  # wrong seed for w-c's config: no match
    }, "workers": [
        {"worker_id": "w-a", "role": "gen", "url": "http://a", "static": True, "healthy": True, "block_size": 8,
         "hash_seed": 3},
        {"worker_id": "w-b", "role": "both", "url": "http://b", "static": True, "healthy": True, "block_size": 4,
         "hash_seed": 0},
        {"worker_id": "w-c", "role": "gen", "url": "http://c", "static": True, "healthy": True, "block_size": 8,
         "hash_seed": 1},
        {"worker_id": "w-d", "role": "ctx", "url": "http://d", "static": True, "healthy": True},
    ]}, Snapshot))
    rows_ = view.candidates("gen", prompt, set())
    assert [(c.worker_id, c.matched_blocks, c.load_requests) for c in rows_] == [
        ("w-a", 2, 0), ("w-b", 9, 1), ("w-c", 0, 0)]
    router = Router(RouterConfig("kv_cache_aware", load_weight=1.0))
    assert router.choose(rows_, RouteRequest(len(prompt))).worker_id == "w-b"  # 9 - 1 > 2
    view.acquire("w-b", 0)
    view.acquire("w-b", 0)
    view.acquire("w-b", 0)
    view.acquire("w-b", 0)
    view.acquire("w-b", 0)
    view.acquire("w-b", 0)
    view.acquire("w-b", 0)  # 9 - 8 = 1 < 2
    assert router.choose(view.candidates("gen", prompt, set()), RouteRequest(len(prompt))).worker_id == "w-a"
    assert [c.worker_id for c in view.candidates("ctx", prompt, {"w-b"})] == ["w-d"]
    # One request's decisions share its hashes: computed once per (block size, seed), then read.
    memo: dict[tuple[int, int], list[int]] = {}
    first = view.candidates("gen", prompt, set(), memo)
    assert memo.keys() == {(8, 3), (4, 0), (8, 1)} and memo[(4, 0)] == list(compute_block_hashes(prompt, 4, 0))
    memo[(4, 0)] = memo[(4, 0)][:3]  # what is in the memo is what routing reads
    again = view.candidates("gen", prompt, set(), memo)
    assert [c.matched_blocks for c in first] == [2, 9, 0] and [c.matched_blocks for c in again] == [2, 3, 0]


def test_worker_record_roles():
    both = WorkerRecord(worker_id="x", role="both", url="http://x", static=True)
    assert both.serves("ctx") and both.serves("gen")
    assert not WorkerRecord(worker_id="y", role="ctx", url="http://y", static=True).serves("gen")


def test_a_suspect_worker_back_in_the_rotation_is_suspect_no_more():
    """A worker suspected for a failed request (2 s) that the health checks then take out and back in
    (it restarted) is routed to at once; one that stayed healthy stays suspect."""
    view = ClusterView(0, default_block_size=16, default_hash_seed=0)

    def snapshot(version: int, healthy: bool) -> Snapshot:
        return msgspec.convert({"version": version, "kv_version": 0, "kv": None, "loads": {}, "workers": [
            {"worker_id": "w-a", "role": "gen", "url": "http://a", "static": True, "healthy": healthy},
            {"worker_id": "w-b", "role": "gen", "url": "http://b", "static": True, "healthy": True},
        ]}, Snapshot)

    view.apply(snapshot(1, True))
    view.suspect("w-a")
    view.suspect("w-b")
    assert view.healthy("gen") == []
    view.apply(snapshot(2, False))  # w-a left the rotation (it died)
    view.apply(snapshot(3, True))  # and came back
    assert [w.worker_id for w in view.healthy("gen")] == ["w-a"]
