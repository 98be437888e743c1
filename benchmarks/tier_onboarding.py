"""KV tiers on the real torch engine: a prompt evicted from the pool, served again from the host
tier, the disk tier, or recomputed; and whether bringing it back stalls the batch it joins.

One ``EngineCore`` in this process (the tiny "bench" model on the CPU, float32, a pool twice the
prompt's and the decoders' blocks). For each source (recompute: tiers off; host; disk: a host tier
of one block; disk-inline: the same, copied on the engine loop instead of its thread, as if
onboarding were not overlapped) it prefills ``--prompt-tokens`` tokens, evicts them with other prompts, starts ``--decoders``
decoding requests, times ``--baseline-steps`` of their steps, then adds the prompt again and
steps until its first token. It prints the prompt's time to first token and its cached tokens,
the steps from its arrival to its first token (the decoders' steps that ran while its blocks were
copied back, and the one that admitted it) with the longest of them against the baseline steps'
median, the copy's own time, and the engine loop's time in the tiers (starting and collecting
the copy: with the thread, bookkeeping; inline, the whole copy, which every request in that
step waits for).

    python benchmarks/tier_onboarding.py [--prompt-tokens 1024] [--decoders 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.engine.core import EngineCore
from workers.engine.model.tiny import make_tiny_model
from workers.protocol import EngineRequest
from workers.sampling_params import SamplingParams

BLOCK_SIZE = 16


def make_core(model: Path, num_blocks: int, host_blocks: int, disk_blocks: int, disk_path: str,
              block_bytes: int, inline: bool) -> EngineCore:
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, host_tier_bytes=host_blocks * block_bytes,
                        disk_tier_path=disk_path if disk_blocks else None, disk_tier_bytes=disk_blocks * block_bytes)
    return EngineCore(EngineConfig(model=str(model), kind="torch", device="cpu", cache=cache,
                                   scheduler=SchedulerConfig(max_num_batched_tokens=4096)), inline_onboarding=inline)


def request(request_id: int, prompt: list[int], max_tokens: int) -> EngineRequest:
    return EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def drain(core: EngineCore) -> None:
    while core.has_unfinished():
        core.step()


def measure(core: EngineCore, args: argparse.Namespace) -> dict[str, Any]:
    prompt = [(37 * i) % 400 + 50 for i in range(args.prompt_tokens + 1)]
    core.add_request(request(1, prompt, 1))
    drain(core)
    for k in range(args.evictors):  # together they fill the pool: the prompt's blocks are evicted
        core.add_request(request(100 + k, [(13 * i + 7 * k) % 400 + 50 for i in range(args.prompt_tokens + 1)], 1))
        drain(core)
    for d in range(args.decoders):
        core.add_request(request(200 + d, [(3 * i + d) % 400 + 50 for i in range(64)], 10_000))
    for _ in range(3):  # their prefills
        core.step()
    baseline = []
    for _ in range(args.baseline_steps):
        started = time.perf_counter()
        core.step()
        baseline.append(time.perf_counter() - started)
    loop_seconds = _time_loop_share(core)
    core.add_request(request(2, prompt, 1))
    added = time.perf_counter()
    during: list[float] = []  # every step from the prompt's arrival to its first token
    first_token = cached = None
    while first_token is None:
        started = time.perf_counter()
        outputs = core.step()
        during.append(time.perf_counter() - started)
        for output in outputs:
            if output.request_id == 2:
                if output.error is not None:
                    raise SystemExit(f"the prompt was refused: {output.error}")
                first_token, cached = time.perf_counter() - added, output.num_cached_tokens
    for d in range(args.decoders):
        core.abort(200 + d)
    drain(core)
    tiers = core.tiers.stats() if core.tiers is not None else None
    core.close()
    return {"ttft_ms": round(first_token * 1e3, 2), "cached_tokens": cached,
            "baseline_step_ms": round(statistics.median(baseline) * 1e3, 2),
            "steps_to_first_token": len(during),
            "max_step_to_first_token_ms": round(max(during) * 1e3, 2),
            "host_hits": tiers.host_hits if tiers else 0, "disk_hits": tiers.disk_hits if tiers else 0,
            "onboard_ms": round(tiers.onboard_seconds * 1e3, 2) if tiers else 0.0,
            "loop_ms": round(loop_seconds[0] * 1e3, 2)}


def _time_loop_share(core: EngineCore) -> list[float]:
    """The engine loop's own time in the tiers (starting the copy, collecting it), summed into the
    returned cell: with the onboarding thread only bookkeeping, inline the whole copy. Less
    sensitive to a loaded machine than step times, which are what it adds to."""
    spent = [0.0]
    if core.tiers is None:
        return spent
    tiers = core.tiers

    def timed(method):  # (a benchmark's instrument: the engine has no timer here)
        def call(*args):
            started = time.perf_counter()
            try:
                return method(*args)
            finally:
                spent[0] += time.perf_counter() - started
        return call

    tiers.onboard = timed(tiers.onboard)  # type: ignore[method-assign]
    tiers.collect = timed(tiers.collect)  # type: ignore[method-assign]
    return spent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="at most 2046 (the tiny model's context)")
    parser.add_argument("--decoders", type=int, default=8)
    parser.add_argument("--baseline-steps", type=int, default=20)
    parser.add_argument("--evictors", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sources", default="recompute,host,disk,disk-inline")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    num_blocks = (args.prompt_tokens // BLOCK_SIZE + 1) * 2 + args.decoders * 8
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny-bench", size="bench")
        config = json.loads((model / "config.json").read_text())
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        block_bytes = config["num_hidden_layers"] * 2 * BLOCK_SIZE * config["num_key_value_heads"] * head_dim * 4
        setups = {"recompute": (0, 0, False), "host": (4 * num_blocks, 0, False), "disk": (1, 4 * num_blocks, False),
                  "disk-inline": (1, 4 * num_blocks, True)}
        setups = {name: setups[name] for name in args.sources.split(",")}
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in setups}
        for _ in range(args.repeats):
            for name, (host, disk, inline) in setups.items():
                core = make_core(model, num_blocks, host, disk, str(Path(tmp) / "kv"), block_bytes, inline)
                results[name].append(measure(core, args))
    print(f"prompt {args.prompt_tokens} tokens ({args.prompt_tokens // BLOCK_SIZE} blocks of {block_bytes} bytes), "
          f"{args.decoders} decoding requests, pool of {num_blocks} blocks; medians of {args.repeats} runs")
    print(f"{'source':<12} {'TTFT ms':>8} {'cached':>7} {'base step ms':>13} {'steps':>6} "
          f"{'max step ms':>12} {'copy ms':>8} {'loop ms':>8}")
    summary = {}
    for name, runs in results.items():
        row = {key: statistics.median(r[key] for r in runs) if isinstance(runs[0][key], (int, float)) else None
               for key in runs[0]}
        summary[name] = row
        print(f"{name:<12} {row['ttft_ms']:>8.1f} {row['cached_tokens']:>7} {row['baseline_step_ms']:>13.2f} "
              f"{row['steps_to_first_token']:>6} {row['max_step_to_first_token_ms']:>12.2f} {row['onboard_ms']:>8.1f} "
              f"{row['loop_ms']:>8.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "summary": summary, "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
