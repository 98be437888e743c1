"""KV transfer across tensor-parallel layouts: every gen rank pulls its own KV heads.

Real workers on the tiny model (2 KV heads: TP 2 puts one on each rank): one
TP-1 and two TP-2 torch workers, each serving both legs, with one cluster
key. For (ctx, gen) TP pairs (1, 2), (2, 1) and (2, 2) the disaggregated
greedy tokens equal those of the same request on the aggregated TP-1
worker, and afterwards no worker has a KV block in use (followers keep no
block state of their own: rank 0's block manager owns every rank's blocks).
"""

from __future__ import annotations

import pytest

from tests.frontends.test_disagg_worker import assert_no_blocks_in_use, completion, disaggregated, post, summary
from tests.worker_process import disagg_worker_args, start_worker, stop_worker, worker_log
from workers.kv_layout import parse_layout

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tp_workers(tiny_model_dir, tmp_path_factory):
    """{name: url} of a TP-1 worker and two TP-2 workers (role both)."""
    procs, urls = [], {}
    cluster = disagg_worker_args(tmp_path_factory.mktemp("key"))
    try:
        for name, tp in (("tp1", 1), ("tp2a", 2), ("tp2b", 2)):
            url, proc = start_worker(tiny_model_dir, 1, "torch", timeout=180, extra_args=[
                "--role", "both", *cluster, "--block-size", str(BLOCK_SIZE),
                "--num-blocks", "256", "--device", "cpu", "--tensor-parallel-size", str(tp)])
            procs.append(proc)
            urls[name] = url
        yield urls
    finally:
        for proc in procs:
            assert stop_worker(proc) == 0, worker_log(proc)


PAIRS = {(1, 2): ("tp1", "tp2a"), (2, 1): ("tp2a", "tp1"), (2, 2): ("tp2a", "tp2b")}


@pytest.mark.slow
@pytest.mark.parametrize("pair", list(PAIRS), ids=lambda p: f"ctx{p[0]}-gen{p[1]}")
def test_disaggregated_tokens_equal_aggregated_tp1(tp_workers, pair):
    ctx, gen = (tp_workers[name] for name in PAIRS[pair])
    offset = 40 * list(PAIRS).index(pair)  # prompts of their own: the gen worker's prefix cache has none of them
    prompts = [list(range(100 + offset, 100 + offset + n)) for n in (3, 9, 17)] + [f"pair {pair}: the quick fox"]
    for prompt in prompts:
        body = completion(prompt, max_tokens=8)
        status, reference = post(tp_workers["tp1"], "/v1/completions", body)
        assert status == 200, reference
        got = disaggregated(ctx, gen, "/v1/completions", body)
        assert summary("/v1/completions", got) == summary("/v1/completions", reference)
    assert_no_blocks_in_use(*tp_workers.values())


@pytest.mark.slow
def test_a_tp2_worker_advertises_each_ranks_kv_heads(tp_workers):
    import httpx

    info = httpx.get(f"{tp_workers['tp2a']}/worker_info", timeout=10).json()
    ranks = parse_layout(info["kv_endpoint"], 2)
    assert [r.kv_heads for r in ranks] == [range(0, 1), range(1, 2)]
    assert len({r.endpoint for r in ranks}) == 2
