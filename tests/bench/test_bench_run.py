"""``disagg bench`` against a real worker (synthetic engine, free port): JSON, plots, compare, all three APIs."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from disagg.bench import BenchPlan, WorkloadConfig, run_bench
from disagg.bench.api_clients import API_CLIENTS
from disagg.bench.lengths import LengthDist
from tests.orchestrator.orchestrator_process import start_orchestrator, stop_orchestrator

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_FIELDS = {"mode", "level", "num_requests", "num_ok", "errors_by_kind", "duration_s", "requests_per_s",
              "output_tokens_per_s", "goodput_requests_per_s", "ttft", "itl", "tpot", "e2e", "prompt_tokens",
              "output_tokens", "cached_tokens", "ttft_p50_by_turn", "records"}


def bench(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disagg.cli", "bench", *argv], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_bench_writes_json_and_plots(worker, tmp_path):
    out = tmp_path / "results"
    done = bench(worker, "--concurrency", "1,3", "--rate", "20", "--num-requests", "9", "--turns", "3",
                 "--isl", "20", "--osl", "8", "--system-tokens", "0", "--tool-turn-fraction", "0.5",
                 "--slo", "ttft=5s,itl=1s", "--out", str(out), "--name", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "disagg bench: concurrency 1: started" in done.stderr  # plain progress lines: not a terminal
    result = json.loads((out / "run.json").read_text())
    assert result["format"] == "disagg-bench/1" and result["api"] == "openai"
    assert result["tokenizer"] == "deployment"  # token counts calibrated through the worker's /tokenize
    assert [(r["mode"], r["level"]) for r in result["runs"]] == [("concurrency", 1), ("concurrency", 3), ("rate", 20)]
    for run in result["runs"]:
        assert RUN_FIELDS <= set(run)
        assert run["num_requests"] == 9 and run["num_ok"] == 9, run["errors_by_kind"]
        assert run["output_tokens_per_s"] > 0 and run["goodput_requests_per_s"] > 0
        assert 0 < run["ttft"]["p50"] <= run["ttft"]["p99"] and run["itl"]["count"] > 0
        assert {r["turn"] for r in run["records"]} >= {0, 1}
        assert all(r["output_tokens"] == 8 and r["prompt_tokens"] > 0 for r in run["records"])
    # turn 1 carries turn 0's prompt and answer: the context grows along a session
    records = result["runs"][0]["records"]
    first = {r["session_id"]: r["prompt_tokens"] for r in records if r["turn"] == 0}
    assert all(r["prompt_tokens"] > first[r["session_id"]] for r in records if r["turn"] == 1)
    for suffix in ("latency-cdf", "sweep", "turns"):
        png = (out / f"run-{suffix}.png").read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 5000

    assert result["ignore_eos"] is False
    server = result["server"]  # a worker: its version and model card; no /cluster_info, no SGLang route
    assert server["version"]["version"] and server["models"]["data"][0]["id"] == result["model"]
    assert server["cluster_info"] is None and server["server_info"] is None

    again = bench(worker, "--concurrency", "1,3", "--num-requests", "4", "--turns", "1", "--osl", "4",
                  "--no-plots", "--out", str(out), "--name", "other", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    refused = bench("compare", str(out / "run.json"), str(out / "other.json"), "--out", str(out), cwd=tmp_path)
    assert refused.returncode == 2 and not refused.stdout
    assert "A and B ran different workloads" in refused.stderr and "pass --force" in refused.stderr
    for difference in ("--osl: 8 vs 4", "--turns: 3 vs 1", "levels: concurrency 1, 3; rate 20 vs concurrency 1, 3"):
        assert difference in refused.stderr
    compared = bench("compare", str(out / "run.json"), str(out / "other.json"), "--force", "--out", str(out),
                     cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr
    assert "warning: the workloads differ: --osl: 8 vs 4" in compared.stderr
    assert "concurrency 3 (A 9 ok, B 4 ok):" in compared.stdout and "B/A" in compared.stdout
    assert "rate 20: only in A" in compared.stdout
    assert (out / "compare-run-vs-other.png").read_bytes().startswith(PNG_MAGIC)


def _figure_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("  ") and "figure" not in line]


def test_compare_of_two_runs_of_one_workload_prints_intervals(worker, tmp_path):
    """Two cold runs (seeds differ, the shape does not) of one level: every figure gets an interval
    and the verdict it implies. Whether these two are within noise depends on this machine's load
    between the runs (a shared CI machine drifts): test_bench_stats checks verdicts on known inputs,
    and a run compared with itself must be within noise on every figure."""
    for seed in ("1", "2"):
        done = bench(worker, "--concurrency", "2", "--num-requests", "30", "--turns", "1", "--isl", "20",
                     "--osl", "6", "--system-tokens", "0", "--slo", "ttft=5s", "--seed", seed, "--no-plots",
                     "--out", str(tmp_path), "--name", f"seed{seed}", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    compared = bench("compare", str(tmp_path / "seed1.json"), str(tmp_path / "seed2.json"), "--no-plots",
                     cwd=tmp_path)
    assert compared.returncode == 0 and not compared.stderr, compared.stderr
    assert compared.stdout.splitlines()[2].startswith("95% intervals of B - A: medians by a bootstrap over requests")
    figures = _figure_lines(compared.stdout)
    assert [f.split()[0] for f in figures] == ["TTFT", "TPOT", "ITL", "E2E", "out", "req/s", "goodput"]
    for figure in figures:
        low, high = (float(v) for v in re.search(r"\[([+-][\d.]+), ([+-][\d.]+)\]", figure).groups())
        if 0 in (low, high):  # printed to 2 decimals: an end this close to 0 may lie on either side of it
            assert figure.endswith(("within noise", "(worse)", "(better)")), figure
        elif low < 0 < high:
            assert figure.endswith("within noise"), figure
        else:
            assert figure.endswith("higher (worse)" if low > 0 else "lower (better)") or \
                figure.endswith("higher (better)" if low > 0 else "lower (worse)"), figure
    # goodput under a 5 s TTFT bound is every request in both runs: the same figure as req/s
    assert figures[-1].split()[2:] == figures[-2].split()[1:]

    itself = bench("compare", str(tmp_path / "seed1.json"), str(tmp_path / "seed1.json"), "--no-plots",
                   cwd=tmp_path)
    assert itself.returncode == 0, itself.stderr
    assert all(f.endswith("within noise") for f in _figure_lines(itself.stdout)), itself.stdout


def test_an_orchestrator_s_cluster_info_is_recorded(worker, tiny_model_dir, tmp_path):
    url, proc = start_orchestrator(tmp_path, tiny_model_dir, workers=[("both", worker)], processes=1)
    try:
        done = bench(url, "--num-requests", "2", "--turns", "1", "--osl", "4", "--system-tokens", "0",
                     "--no-plots", "--out", str(tmp_path), "--name", "orch", cwd=tmp_path)
    finally:
        assert stop_orchestrator(proc) == 0
    assert done.returncode == 0, done.stderr
    server = json.loads((tmp_path / "orch.json").read_text())["server"]
    assert server["version"]["version"]
    assert [w["url"] for w in server["cluster_info"]["workers"]] == [worker]
    assert "ctx_router" in server["cluster_info"] and "gen_router" in server["cluster_info"]


@pytest.mark.parametrize("api", ["anthropic", "responses"])
def test_other_apis_multi_turn_with_tool_exchanges(worker, api):
    workload = WorkloadConfig(system_tokens=0, isl=LengthDist(20), osl=LengthDist(6), turns=LengthDist(3),
                              tool_turn_fraction=1.0)
    plan = BenchPlan(url=worker, api=API_CLIENTS[api]("tiny-test", ignore_eos=False), workload=workload,
                     concurrencies=(2,), num_requests=6, warmup=1)
    (level,), _ = asyncio.run(run_bench(plan))
    assert level.summary.num_ok == 6, [r.error for r in level.records]
    assert all(r.output_tokens > 0 and r.prompt_tokens for r in level.records)
    assert level.summary.ttft.count == 6 and level.summary.tpot.p50 is not None
    if api == "anthropic":  # the shared system prompt is a prefix-cache hit, reported in usage
        assert any(r.cached_tokens for r in level.records)


def test_errors_are_counted_by_kind(worker):
    # prompts longer than the tiny model's context: every request is a 400 from the server, none a crash
    workload = WorkloadConfig(system_tokens=0, isl=LengthDist(12000), osl=LengthDist(4), turns=LengthDist(1))
    plan = BenchPlan(url=worker, api=API_CLIENTS["openai"]("tiny-test"), workload=workload, concurrencies=(2,),
                     num_requests=3)
    (level,), _ = asyncio.run(run_bench(plan))
    assert level.summary.errors_by_kind == {"http_400": 3} and level.summary.num_ok == 0
