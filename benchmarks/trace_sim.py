"""The whole Mooncake conversation hour at cluster scale, simulated (issue 29 item 6): how the cached
fraction and TTFT change with the number of workers and the KV pool per worker.

Each point is ``disagg simulate`` (``disagg.sim``: the real routers, KV index, schedulers and block
managers in simulated time) of the whole trace on ``ctx`` context workers and ``ctx / 3`` generation
workers (16, 32 and 64 workers in all by default), KV-cache-aware routing on both legs, pools of
``--pools`` blocks. Prompts are scaled by ``--block-tokens 16`` (each trace block of 512 tokens is one
engine block of 16), so the timing model is set per scaled token: ``--prefill-ms-per-block`` is the
prefill time of one 512-token trace block (default 25 ms: ~20k tokens/s, a large model's ctx worker
on one 8-GPU node), decode steps take ``--decode-step-ms``, and ``--time-scale`` compresses the hour
(0.25: four times the trace's rate, ~14 requests/s of ~12k tokens: the 12 ctx workers about 70% busy).

Prints one row per point (cached fraction, its share of the ceiling, TTFT p50/p90, CPU seconds the
simulation took), writes JSON and a PNG: cached fraction and TTFT p90 against the pool size, one line
per cluster size.

    python benchmarks/trace_sim.py [--trace ../shared/traces/mooncake_conversation_trace.jsonl]
        [--ctx 12,24,48] [--pools 1024,4096,16384] [--time-scale 0.25] [--window 0:3600]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disagg.bench.api_clients import OpenAICompletions
from disagg.bench.metrics import parse_slo
from disagg.bench.trace import TokenMap, load_trace, parse_window
from disagg.bench.trace_replay import TracePlan
from disagg.deploy_config import load_deploy_config
from disagg.sim import simulate_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def synthetic_deployment(ctx: int, gen: int, num_blocks: int, policy: str, args: argparse.Namespace,
                         host_tier_blocks: int = 0) -> dict:
    """The deployment YAML (as a dict) of ``ctx`` + ``gen`` synthetic workers whose prefill costs
    ``args.prefill_ms_per_block`` per trace block (of ``args.block_tokens`` tokens); ``policy`` routes the
    ctx leg, the gen leg is KV-aware (a turn decodes where its history is), no conditional skip (every
    prompt takes the ctx leg, so the ctx pools alone decide the cached fraction). Free ports.
    ``host_tier_blocks``: each engine's host KV tier, in blocks (0: no tiers), bringing a block back
    costs ``args.onboard_ms_per_block`` per trace block."""
    tiers = {} if not host_tier_blocks else {
        "host_tier_bytes": host_tier_blocks * 8 * 16,  # the synthetic engine's block: one int64 a token
        "synthetic_onboard_seconds_per_block": args.onboard_ms_per_block * 1e-3 * 16 / args.block_tokens}
    return {"model": "tiny", "engine": {
        "kind": "synthetic", "block_size": 16, "num_blocks": num_blocks, "max_model_len": 32768,
        "max_num_seqs": 128, "max_num_batched_tokens": 8192,
        "synthetic_prefill_seconds_per_token": args.prefill_ms_per_block * 1e-3 / args.block_tokens,
        "synthetic_decode_step_seconds": args.decode_step_ms * 1e-3, **tiers},
        "orchestrator": {"host": "127.0.0.1", "port": 0, "processes": 1, "ctx_router": {"policy": policy},
                         "gen_router": {"policy": "kv_cache_aware"}, "conditional": {"enabled": False}},
        "pools": {"ctx": {"instances": ctx, "frontends": 1, "base_port": 0},
                  "gen": {"instances": gen, "frontends": 1, "base_port": 0}},
        "startup_timeout_seconds": 300}


def point(ctx: int, num_blocks: int, args: argparse.Namespace, plan: TracePlan, tmp: Path) -> dict:
    gen = max(1, ctx // 3)
    path = tmp / f"sim-{ctx}-{num_blocks}.yaml"
    path.write_text(yaml.safe_dump(synthetic_deployment(ctx, gen, num_blocks, "kv_cache_aware", args)))
    started = time.process_time()
    summary = simulate_trace(load_deploy_config(path), plan).summary
    return {"ctx": ctx, "gen": gen, "workers": ctx + gen, "num_blocks": num_blocks,
            "cached_fraction": summary.cached_fraction or 0.0, "ttft_p50_s": summary.ttft.p50,
            "ttft_p90_s": summary.ttft.p90, "goodput_requests_per_s": summary.goodput_requests_per_s,
            "num_ok": summary.num_ok, "num_requests": summary.num_requests,
            "cpu_seconds": time.process_time() - started}


def plot(rows: list[dict], ceiling: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    pools = sorted({r["num_blocks"] for r in rows})
    for workers in sorted({r["workers"] for r in rows}):
        line = sorted((r for r in rows if r["workers"] == workers), key=lambda r: r["num_blocks"])
        label = f"{workers} workers ({line[0]['ctx']} ctx + {line[0]['gen']} gen)"
        left.plot([r["num_blocks"] for r in line], [r["cached_fraction"] for r in line], "o-", label=label)
        right.plot([r["num_blocks"] for r in line], [r["ttft_p90_s"] * 1e3 for r in line], "o-", label=label)
    left.axhline(ceiling, color="grey", linestyle="--", label=f"ceiling {ceiling:.3f}")
    for ax, title, unit in ((left, "cached fraction of prompt tokens", "fraction"), (right, "TTFT p90", "ms")):
        ax.set(xscale="log", xlabel="KV pool per worker (blocks of 512 trace tokens)", ylabel=unit, title=title)
        ax.set_xticks(pools, [str(p) for p in pools])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("Mooncake conversation trace, simulated (disagg simulate)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--window", default=None, help="seconds of the trace (default: all of it)")
    parser.add_argument("--ctx", type=_ints, default=[12, 24, 48], help="ctx workers per cluster (gen: a third)")
    parser.add_argument("--pools", type=_ints, default=[1024, 4096, 16384], help="KV blocks per worker")
    parser.add_argument("--time-scale", type=float, default=0.25)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--prefill-ms-per-block", type=float, default=25.0)
    parser.add_argument("--decode-step-ms", type=float, default=30.0)
    parser.add_argument("--max-output-tokens", type=int, default=32, help="cap outputs (the decode side is not "
                                                                          "what is measured here)")
    parser.add_argument("--slo", default="ttft=2s")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/trace_sim.json"))
    args = parser.parse_args()

    window = parse_window(args.window)
    requests = load_trace(args.trace, window)
    plan = TracePlan(url="sim", api=OpenAICompletions("tiny", True), path=args.trace, window=window,
                     requests=requests, token_map=TokenMap(block_tokens=args.block_tokens),
                     time_scale=args.time_scale, max_output_tokens=args.max_output_tokens, slo=parse_slo(args.slo))
    ceiling = plan.ceiling.tokens
    print(f"{len(requests)} requests of {args.trace.name} over {requests[-1].timestamp / 1e3 * args.time_scale:.0f} "
          f"simulated s; ceiling {ceiling:.3f} of prompt tokens")
    rows = []
    with tempfile.TemporaryDirectory(prefix="disagg-sim-") as tmp:
        for ctx in args.ctx:
            for num_blocks in args.pools:
                row = point(ctx, num_blocks, args, plan, Path(tmp))
                rows.append(row)
                print(f"{row['workers']:3d} workers, {num_blocks:6d} blocks each: cached {row['cached_fraction']:.3f}"
                      f" ({row['cached_fraction'] / ceiling:.2f} of the ceiling), TTFT p50 "
                      f"{row['ttft_p50_s'] * 1e3:7.0f} ms p90 {row['ttft_p90_s'] * 1e3:7.0f} ms, goodput "
                      f"{row['goodput_requests_per_s'] or 0:.1f} req/s; {row['cpu_seconds']:.0f} CPU s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"requests": len(requests), "ceiling_tokens": ceiling,
                                    "settings": {**vars(args), "trace": str(args.trace), "out": str(args.out)},
                                    "points": rows}, indent=1) + "\n")
    png = args.out.with_suffix(".png")
    plot(rows, ceiling, png)
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
