"""Routing measured on a real trace (issue 29 item 5): one window of a Mooncake-format trace replayed
on a deployment of synthetic engines, once per ctx routing policy.

Each policy gets a fresh deployment (12 ctx workers, 4 gen workers, synthetic engines whose prefill
costs ``--prefill-ms-per-block`` per uncached trace block, so a prefix-cache hit shows in TTFT; the
deployment is ``trace_sim.synthetic_deployment``'s), with KV pools of ``--num-blocks`` blocks each,
sized below the window's working set (printed), so that what a worker keeps depends on what is
routed to it. The default load keeps round robin's ctx workers busy most of the time (the trace's
first ten minutes at four times their rate), where what a hit saves shows in the queue. The window is replayed with ``disagg bench
--trace``'s library at its own times (``--time-scale``), each hash id as ``--block-tokens`` token
ids (a multiple of the engine's block size, so shared trace blocks are whole cache blocks).

Prints, per policy: cached fraction of prompt tokens, that fraction over the window's ceiling (what
one infinite cache shared by every worker would hold), TTFT p50/p90 and goodput under ``--slo``; and
the two targets of the issue: kv_cache_aware against round_robin, cached fraction >= 2x and TTFT p90
<= 0.5x. Beside each real row, the same window on the same YAML through ``disagg simulate``
(``disagg.sim``), and how far apart they are (the simulation's targets: cached fraction within 0.02,
TTFT p50 within 15%). With ``--tiers off,on`` each policy also runs with a host KV tier of
``--host-tier-blocks`` per engine under its pool (bringing a block back costs ``--onboard-ms-per-block``
per trace block; ``--real-tiers`` says which runs get a real deployment, the others are simulated
only). Writes JSON.

    python benchmarks/trace_routing.py [--trace ../shared/traces/mooncake_conversation_trace.jsonl]
        [--window 0:600] [--time-scale 0.25] [--policies round_robin,least_load,kv_cache_aware]
        [--ctx 12] [--gen 4] [--num-blocks 2048] [--tiers off,on] [--host-tier-blocks 16384]
        [--out benchmarks/results/trace_routing.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trace_sim import synthetic_deployment

from disagg.bench.api_clients import OpenAICompletions
from disagg.bench.metrics import parse_slo
from disagg.bench.progress import PlainProgress
from disagg.bench.trace import TokenMap, load_trace, parse_window
from disagg.bench.trace_replay import TracePlan, replay_trace
from disagg.deploy_config import load_deploy_config
from disagg.sim import simulate_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def _disagg(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disagg.cli", *argv], capture_output=True, text=True)


def run_policy(policy: str, tiers: bool, real: bool, args: argparse.Namespace, plan: TracePlan, tmp: Path) -> dict:
    """One policy with tiers off or on: a real replay (``real``) and the simulation beside it."""
    name = f"{policy}-tiers" if tiers else policy
    run_dir = tmp / name
    config = tmp / f"{name}.yaml"
    host_tier_blocks = args.host_tier_blocks if tiers else 0
    config.write_text(yaml.safe_dump({**synthetic_deployment(args.ctx, args.gen, args.num_blocks, policy, args,
                                                             host_tier_blocks), "run_dir": str(run_dir)}))
    simulated = _figures(simulate_trace(load_deploy_config(config), plan).summary)
    if not real:
        return {"policy": policy, "tiers": tiers, "real": False, **simulated, "simulated": simulated}
    up = _disagg("up", str(config))
    if up.returncode != 0:
        raise SystemExit(f"disagg up failed ({name}):\n{up.stdout}\n{up.stderr}")
    try:
        url = json.loads((run_dir / "state.json").read_text())["url"]
        level = asyncio.run(replay_trace(dataclasses.replace(plan, url=url), PlainProgress(sys.stderr)))
    finally:
        _disagg("down", "--run-dir", str(run_dir))
    return {"policy": policy, "tiers": tiers, "real": True, **_figures(level.summary), "simulated": simulated}


def _figures(s) -> dict:  # s: a disagg.bench.metrics.RunSummary
    return {"num_ok": s.num_ok, "num_requests": s.num_requests, "cached_fraction": s.cached_fraction or 0.0,
            "ttft_p50_s": s.ttft.p50, "ttft_p90_s": s.ttft.p90, "tpot_p50_s": s.tpot.p50,
            "goodput_requests_per_s": s.goodput_requests_per_s, "requests_per_s": s.requests_per_s,
            "errors": s.errors_by_kind}


def _line(label: str, row: dict, ceiling: float) -> str:
    return (f"{label:24s} cached {row['cached_fraction']:.3f} = {row['cached_fraction'] / ceiling:.2f} of the "
            f"ceiling; TTFT p50 {row['ttft_p50_s'] * 1e3:6.0f} ms p90 {row['ttft_p90_s'] * 1e3:6.0f} ms; goodput "
            f"{row['goodput_requests_per_s']:.2f} req/s ({row['num_ok']}/{row['num_requests']} ok)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--window", default="0:600", help="seconds of the trace (default 0:600)")
    parser.add_argument("--time-scale", type=float, default=0.25, help="trace time x this (0.25: 4x the rate)")
    parser.add_argument("--block-tokens", type=int, default=16, help="token ids per hash id (default 16)")
    parser.add_argument("--max-output-tokens", type=int, default=32)
    parser.add_argument("--policies", default="round_robin,least_load,kv_cache_aware")
    parser.add_argument("--ctx", type=int, default=12)
    parser.add_argument("--gen", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per engine (the 12 ctx pools "
                        "together hold less than the default window's working set)")
    parser.add_argument("--prefill-ms-per-block", type=float, default=25.0,
                        help="prefill time of one trace block (default 25 ms: ~20k tokens/s at 512 a block)")
    parser.add_argument("--decode-step-ms", type=float, default=30.0)
    parser.add_argument("--slo", default="ttft=2s", help="goodput bounds (default ttft=2s)")
    parser.add_argument("--tiers", default="off", help="off, on, or off,on: runs without and with host KV tiers")
    parser.add_argument("--host-tier-blocks", type=int, default=16384, help="host KV tier per engine, in blocks")
    parser.add_argument("--onboard-ms-per-block", type=float, default=2.5,
                        help="bringing one trace block back from the host tier (default 2.5 ms: a tenth of "
                             "its prefill)")
    parser.add_argument("--real-tiers", default="off,on", help="which of --tiers get a real deployment beside "
                        "the simulation (the others are simulated only)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/trace_routing.json"))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still takes its deployment down

    token_map = TokenMap(block_tokens=args.block_tokens)
    window = parse_window(args.window)
    requests = load_trace(args.trace, window)
    plan = TracePlan(url="", api=OpenAICompletions("tiny", True), path=args.trace, window=window,
                     requests=requests, token_map=token_map, time_scale=args.time_scale,
                     max_output_tokens=args.max_output_tokens, slo=parse_slo(args.slo))
    ceiling = plan.ceiling
    distinct = len({h for r in requests for h in r.hash_ids})
    blocks_per_id = max(1, args.block_tokens // 16)
    print(f"window {window} of {args.trace.name}: {len(requests)} requests over "
          f"{requests[-1].timestamp / 1e3 * args.time_scale:.0f} s replayed; ceiling {ceiling.tokens:.3f} of prompt "
          f"tokens; working set {distinct * blocks_per_id} blocks against {args.ctx} x {args.num_blocks} ctx blocks")
    rows = []
    with tempfile.TemporaryDirectory(prefix="disagg-trace-") as tmp:
        for tiers in args.tiers.split(","):
            for policy in args.policies.split(","):
                real = tiers in args.real_tiers.split(",")
                rows.append(run_policy(policy, tiers == "on", real, args, plan, Path(tmp)))
                row, sim = rows[-1], rows[-1]["simulated"]
                label = f"{policy}, tiers {tiers}" + ("" if real else " (simulated)")
                print(_line(label, row, ceiling.tokens), flush=True)
                if real:
                    row["sim_cached_delta"] = sim["cached_fraction"] - row["cached_fraction"]
                    row["sim_ttft_p50_ratio"] = sim["ttft_p50_s"] / row["ttft_p50_s"]
                    print(_line("  simulated", sim, ceiling.tokens) + f"; cached {row['sim_cached_delta']:+.3f}, "
                          f"TTFT p50 {row['sim_ttft_p50_ratio']:.2f}x the real", flush=True)
    targets = {}
    for tiers in (False, True):
        by_policy = {row["policy"]: row for row in rows if row["tiers"] is tiers}
        if {"round_robin", "kv_cache_aware"} <= set(by_policy):
            rr, kv = by_policy["round_robin"], by_policy["kv_cache_aware"]
            cached_ratio = kv["cached_fraction"] / max(rr["cached_fraction"], 1e-9)
            p90_ratio = kv["ttft_p90_s"] / rr["ttft_p90_s"]
            targets["tiers_on" if tiers else "tiers_off"] = {"cached_ratio": cached_ratio, "ttft_p90_ratio": p90_ratio}
            print(f"tiers {'on' if tiers else 'off'}: kv_cache_aware / round_robin: cached fraction "
                  f"{cached_ratio:.2f}x (target >= 2: {'PASS' if cached_ratio >= 2 else 'FAIL'}), TTFT p90 "
                  f"{p90_ratio:.2f}x (target <= 0.5: {'PASS' if p90_ratio <= 0.5 else 'FAIL'})")
        if "kv_cache_aware" in by_policy and tiers:
            share = by_policy["kv_cache_aware"]["cached_fraction"] / ceiling.tokens
            targets["tiers_on_kv_cache_aware_of_ceiling"] = share
            print(f"tiers on, kv_cache_aware: cached fraction {share:.2f} of the ceiling (target >= 0.9: "
                  f"{'PASS' if share >= 0.9 else 'FAIL'})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"window": str(window), "time_scale": args.time_scale, "requests": len(requests),
                            "ceiling_tokens": ceiling.tokens, "ceiling_blocks": ceiling.blocks,
                            "working_set_blocks": distinct * blocks_per_id,
                            "settings": {**vars(args), "trace": str(args.trace), "out": str(args.out)},
                            "policies": rows, "targets": targets}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
