"""``disagg simulate``: a trace through a deployment in simulated time, with the real routers, KV index,
schedulers and block managers (``disagg.sim``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from disagg.bench.api_clients import OpenAICompletions
from disagg.bench.trace import TokenMap, TraceRequest, TraceWindow
from disagg.bench.trace_replay import TracePlan
from disagg.deploy_config import load_deploy_config
from disagg.sim import SimTiming, simulate_trace
from tests.bench.test_trace import write_trace
from tests.bench.test_trace_replay import conversations


def deployment(tmp_path, *, ctx: int = 1, gen: int = 1, policy: str = "kv_cache_aware", num_blocks: int = 4096,
               prefill: float = 0.001, decode: float = 0.01, conditional: bool = False, kv_pool: bool = False):
    path = tmp_path / f"sim-{policy}-{ctx}-{num_blocks}-{kv_pool}.yaml"
    path.write_text(textwrap.dedent(f"""\
        model: tiny
        engine: {{kind: synthetic, block_size: 16, num_blocks: {num_blocks}, max_model_len: 8192,
                 synthetic_prefill_seconds_per_token: {prefill}, synthetic_decode_step_seconds: {decode}}}
        orchestrator: {{ctx_router: {{policy: {policy}}}, gen_router: {{policy: kv_cache_aware}},
                       conditional: {{enabled: {str(conditional).lower()}}}, health: {{interval_seconds: 0.1}},
                       kv_pool: {{enabled: {str(kv_pool).lower()}, min_blocks: 1}}}}
        pools: {{ctx: {{instances: {ctx}}}, gen: {{instances: {gen}}}}}
    """))
    return load_deploy_config(path)


def plan_of(requests: list[TraceRequest], block_tokens: int = 16, max_output_tokens: int | None = None) -> TracePlan:
    return TracePlan(url="sim", api=OpenAICompletions("tiny", True), path=Path("sim"), window=TraceWindow(),
                     requests=requests, token_map=TokenMap(block_tokens=block_tokens),
                     max_output_tokens=max_output_tokens)


def test_one_request_takes_the_timing_models_time_exactly(tmp_path):
    """hop 2 ms, a 64-token prefill at 1 ms a token, hop 2 ms: the first token at 68 ms. The gen engine
    pulls the 4 prompt blocks (2 ms + 64 x 4096 B at 1 GB/s) and decodes tokens 2 to 5, 10 ms a step."""
    level = simulate_trace(deployment(tmp_path), plan_of([TraceRequest(0, 2048, 5, [1, 2, 3, 4])]),
                           SimTiming(hop_seconds=0.002, pull_latency_seconds=0.002, transfer_bytes_per_second=1e9,
                                     kv_bytes_per_token=4096))
    (record,) = level.records
    assert record.ok and record.prompt_tokens == 64 and record.cached_tokens == 0 and record.output_tokens == 5
    assert record.ttft == pytest.approx(0.068)
    assert record.e2e == pytest.approx(0.068 + 0.002 + 64 * 4096 / 1e9 + 4 * 0.010)


def test_a_cache_that_holds_everything_meets_the_ceiling(tmp_path):
    """The conversations that a real worker replays at the ceiling (tests/bench/test_trace_replay.py)."""
    requests = [TraceRequest(**line) for line in conversations()]
    plan = plan_of(requests)
    level = simulate_trace(deployment(tmp_path), plan)
    assert level.summary.num_ok == len(requests) == 12
    assert [r.output_tokens for r in level.records] == [r.output_length for r in requests]
    assert level.summary.cached_fraction == pytest.approx(plan.ceiling.tokens)
    # a hit is a shorter prefill: turn 3 prefills one new block where turn 0 prefilled two
    ttft = [r.ttft for r in level.records]
    assert ttft[9] < ttft[0]


def seven_conversations(turns: int = 6) -> list[TraceRequest]:
    """Seven conversations taking turns, each turn one new block after its whole history."""
    lines, next_id = [], 1000
    history = {c: [c * 100 + 1] for c in range(7)}
    for _turn in range(turns):
        for c in range(7):
            history[c] = [*history[c], next_id]
            next_id += 1
            lines.append(TraceRequest(len(lines) * 50, 512 * len(history[c]), 2, list(history[c])))
    return lines


def test_the_routing_policy_decides_what_small_pools_keep(tmp_path):
    """Seven conversations of six turns (seven: round robin over four workers does not send a
    conversation back to the same one by chance) over four ctx workers whose pools hold about two
    conversations each: round robin spreads every conversation over every worker (each evicts what the
    others need), the KV-aware router keeps a conversation where its blocks are."""
    lines = seven_conversations()
    cached = {}
    for policy in ("round_robin", "kv_cache_aware"):
        level = simulate_trace(deployment(tmp_path, ctx=4, policy=policy, num_blocks=20, prefill=1e-4), plan_of(lines))
        assert level.summary.num_ok == len(lines)
        cached[policy] = level.summary.cached_fraction
    assert cached["kv_cache_aware"] == pytest.approx(plan_of(lines).ceiling.tokens)
    assert cached["round_robin"] < 0.5 * cached["kv_cache_aware"], cached


def test_the_kv_pool_gives_round_robin_the_ceiling(tmp_path):
    """Round robin sends each turn of a conversation to another ctx worker, which lacks the earlier
    turns; with the KV pool on it pulls them from the worker that holds them (the gen worker that
    decoded the last turn, or a ctx worker), so every cached token the ceiling allows is found, in
    the same time a KV-aware router takes."""
    requests = seven_conversations()
    plan = plan_of(requests)
    off = simulate_trace(deployment(tmp_path, ctx=4, policy="round_robin", prefill=0.001), plan)
    on = simulate_trace(deployment(tmp_path, ctx=4, policy="round_robin", prefill=0.001, kv_pool=True), plan)
    assert off.summary.num_ok == on.summary.num_ok == len(requests)
    assert off.summary.cached_fraction < 0.8 * plan.ceiling.tokens
    assert on.summary.cached_fraction == pytest.approx(plan.ceiling.tokens)
    assert [r.output_tokens for r in on.records] == [r.output_tokens for r in off.records]
    assert sum(r.ttft for r in on.records) < sum(r.ttft for r in off.records)


def test_disagg_simulate_writes_a_bench_results_file(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", conversations())
    config = tmp_path / "d.yaml"
    config.write_text("model: tiny\nengine: {kind: synthetic, synthetic_prefill_seconds_per_token: 0.001}\n"
                      "pools: {ctx: {instances: 2}, gen: {instances: 1}}\n")
    done = subprocess.run([sys.executable, "-m", "disagg.cli", "simulate", str(config), "--trace", str(trace),
                           "--block-tokens", "16", "--slo", "ttft=1s", "--out", str(tmp_path), "--name", "sim"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "of the ceiling" in done.stdout
    result = json.loads((tmp_path / "sim.json").read_text())
    assert result["format"] == "disagg-bench/1" and result["url"] == f"sim:{config}"
    (run,) = result["runs"]
    assert run["mode"] == "trace" and run["num_ok"] == 12 and result["simulation"]["cpu_seconds"] > 0
    config.write_text("model: tiny\npools: {ctx: {instances: 0}}\n")
    bad = subprocess.run([sys.executable, "-m", "disagg.cli", "simulate", str(config), "--trace", str(trace)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "pools.ctx.instances" in bad.stderr, bad.stderr
    missing = subprocess.run([sys.executable, "-m", "disagg.cli", "simulate", str(config)], capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 2 and "--trace" in missing.stderr
