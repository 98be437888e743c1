"""The deployment-wide KV pool measured on a real trace (issue 29 item 4): one window of a Mooncake-format
trace replayed on a deployment of synthetic engines with ``orchestrator.kv_pool`` off and on, rounds
interleaved (off, on, off, on, ...), each run on a fresh deployment.

The ctx router is round robin by default: each turn of a conversation lands on another ctx worker, so
what the pool saves is what routing could not (``--policy kv_cache_aware`` shows what is left when
routing already follows the cache). The synthetic engines charge ``--prefill-ms-per-block`` per
uncached trace block (so a pulled prefix shows in TTFT), and a pull moves the blocks' real bytes over
the KV-transfer path. Prints per arm the median and range over rounds of: the cached fraction of
prompt tokens (the usage's cached tokens: local hits and pulled blocks), that fraction over the
window's ceiling, TTFT p50 and p90, goodput under ``--slo``, and the fetches the orchestrator made;
then on/off ratios of the medians. Writes JSON.

    python benchmarks/kv_pool.py [--trace ../shared/traces/mooncake_conversation_trace.jsonl]
        [--window 0:300] [--time-scale 0.25] [--rounds 2] [--ctx 4] [--gen 2] [--num-blocks 2048]
        [--policy round_robin] [--out benchmarks/results/kv_pool.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trace_sim import synthetic_deployment

from disagg.bench.api_clients import OpenAICompletions
from disagg.bench.metrics import parse_slo
from disagg.bench.progress import PlainProgress
from disagg.bench.trace import TokenMap, load_trace, parse_window
from disagg.bench.trace_replay import TracePlan, replay_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
FETCHES = 'disagg_orchestrator_kv_pool_fetches_total{outcome="parked"}'
ARMS = ("off", "on")


def _disagg(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disagg.cli", *argv], capture_output=True, text=True)


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def run_arm(arm: str, round_index: int, args: argparse.Namespace, plan: TracePlan, tmp: Path) -> dict:
    run_dir = tmp / f"{arm}-{round_index}"
    deployment = synthetic_deployment(args.ctx, args.gen, args.num_blocks, args.policy, args)
    deployment["orchestrator"]["kv_pool"] = {"enabled": arm == "on"}
    config = tmp / f"{arm}-{round_index}.yaml"
    config.write_text(yaml.safe_dump({**deployment, "run_dir": str(run_dir)}))
    up = _disagg("up", str(config))
    if up.returncode != 0:
        raise SystemExit(f"disagg up failed ({arm}):\n{up.stdout}\n{up.stderr}")
    try:
        url = json.loads((run_dir / "state.json").read_text())["url"]
        level = asyncio.run(replay_trace(dataclasses.replace(plan, url=url), PlainProgress(sys.stderr)))
        fetches = _metric(url, FETCHES)
    finally:
        _disagg("down", "--run-dir", str(run_dir))
    s = level.summary
    return {"arm": arm, "round": round_index, "cached_fraction": s.cached_fraction or 0.0,
            "ttft_p50_s": s.ttft.p50, "ttft_p90_s": s.ttft.p90, "goodput_requests_per_s": s.goodput_requests_per_s,
            "num_ok": s.num_ok, "num_requests": s.num_requests, "fetches": fetches}


def _spread(rows: list[dict], key: str) -> tuple[float, float, float]:
    values = [row[key] for row in rows]
    return statistics.median(values), min(values), max(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--window", default="0:300", help="seconds of the trace (default 0:300)")
    parser.add_argument("--time-scale", type=float, default=0.25, help="trace time x this (0.25: 4x the rate)")
    parser.add_argument("--block-tokens", type=int, default=16, help="token ids per hash id (default 16)")
    parser.add_argument("--max-output-tokens", type=int, default=32)
    parser.add_argument("--policy", default="round_robin", help="the ctx router's policy (default round_robin)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4)
    parser.add_argument("--gen", type=int, default=2)
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument("--prefill-ms-per-block", type=float, default=25.0)
    parser.add_argument("--decode-step-ms", type=float, default=30.0)
    parser.add_argument("--slo", default="ttft=2s")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_pool.json"))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still takes its deployment down

    window = parse_window(args.window)
    requests = load_trace(args.trace, window)
    plan = TracePlan(url="", api=OpenAICompletions("tiny", True), path=args.trace, window=window,
                     requests=requests, token_map=TokenMap(block_tokens=args.block_tokens),
                     time_scale=args.time_scale, max_output_tokens=args.max_output_tokens, slo=parse_slo(args.slo))
    ceiling = plan.ceiling.tokens
    print(f"window {window}: {len(requests)} requests; ceiling {ceiling:.3f} of prompt tokens; "
          f"{args.ctx} ctx + {args.gen} gen, ctx router {args.policy}, {args.rounds} interleaved rounds")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="disagg-kvpool-") as tmp:
        for round_index in range(args.rounds):
            for arm in ARMS:
                rows.append(run_arm(arm, round_index, args, plan, Path(tmp)))
                row = rows[-1]
                print(f"round {round_index} pool {arm:3s}: cached {row['cached_fraction']:.3f}, TTFT p50 "
                      f"{row['ttft_p50_s'] * 1e3:.0f} ms p90 {row['ttft_p90_s'] * 1e3:.0f} ms, "
                      f"{row['num_ok']}/{row['num_requests']} ok, {row['fetches']:.0f} fetches", flush=True)
    summary = {}
    for arm in ARMS:
        arm_rows = [row for row in rows if row["arm"] == arm]
        summary[arm] = {key: _spread(arm_rows, key) for key in
                        ("cached_fraction", "ttft_p50_s", "ttft_p90_s", "goodput_requests_per_s", "fetches")}
        cached, p50, p90 = summary[arm]["cached_fraction"], summary[arm]["ttft_p50_s"], summary[arm]["ttft_p90_s"]
        print(f"pool {arm:3s} (median [min, max]): cached {cached[0]:.3f} [{cached[1]:.3f}, {cached[2]:.3f}] = "
              f"{cached[0] / ceiling:.2f} of the ceiling; TTFT p50 {p50[0] * 1e3:.0f} ms "
              f"[{p50[1] * 1e3:.0f}, {p50[2] * 1e3:.0f}], p90 {p90[0] * 1e3:.0f} ms [{p90[1] * 1e3:.0f}, "
              f"{p90[2] * 1e3:.0f}]")
    ratios = {"cached": summary["on"]["cached_fraction"][0] / max(summary["off"]["cached_fraction"][0], 1e-9),
              "ttft_p50": summary["on"]["ttft_p50_s"][0] / summary["off"]["ttft_p50_s"][0],
              "ttft_p90": summary["on"]["ttft_p90_s"][0] / summary["off"]["ttft_p90_s"][0]}
    print(f"pool on / off: cached fraction {ratios['cached']:.2f}x, TTFT p50 {ratios['ttft_p50']:.2f}x, "
          f"p90 {ratios['ttft_p90']:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"window": str(window), "requests": len(requests), "ceiling_tokens": ceiling,
                                    "settings": {**vars(args), "trace": str(args.trace), "out": str(args.out)},
                                    "runs": rows, "summary": summary, "ratios": ratios}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
