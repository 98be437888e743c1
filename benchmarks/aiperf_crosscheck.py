"""``disagg bench`` against aiperf on the same server and workload: TTFT and ITL p50 within 10%.

aiperf (``pip install aiperf``; it pins versions of packages this project uses, so give it a
virtual environment of its own and pass its executable) and disagg bench's library run the same
single-turn streamed chat workload (``--isl`` prompt tokens, ``--osl`` output tokens with
ignore_eos, ``--concurrency``, ``--request-count``) one after the other, ``--repeats`` times,
alternating. aiperf's "inter token latency" is per request (latency - TTFT) / (tokens - 1),
which disagg bench calls TPOT; both that pair and disagg bench's chunk-gap ITL are printed.

    python benchmarks/aiperf_crosscheck.py --url http://127.0.0.1:8000 --aiperf /path/to/venv/bin/aiperf \\
        --tokenizer DIR [--model NAME] [--concurrency 4] [--request-count 40] [--isl 200] [--osl 24]

``--tokenizer`` is a Hugging Face tokenizer directory (``tokenizer.json``) for aiperf's prompts;
``--export-gguf-tokenizer DIR`` writes one from the model's GGUF file first (SmolLM2 ships as GGUF).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disagg.bench import BenchPlan, WorkloadConfig, run_bench
from disagg.bench.api_clients import OpenAIChat
from disagg.bench.lengths import LengthDist

TOLERANCE = 0.10


def export_gguf_tokenizer(model: str, out: Path) -> Path:
    """tokenizer.json + tokenizer_config.json from a GGUF model (a short name or a path)."""
    from disagg.model_names import resolve_model
    from workers.engine.model.gguf_tokenizer import tokenizer_from_gguf

    backend, config = tokenizer_from_gguf(resolve_model(model))
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    plain = {k: v for k, v in config.items() if v is None or isinstance(v, (str, int, float, bool))}
    (out / "tokenizer_config.json").write_text(json.dumps({**plain, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return out


def run_aiperf(args: argparse.Namespace, artifacts: Path) -> dict[str, float]:
    argv = [args.aiperf, "profile", "--model", args.model, "--url", args.url, "--endpoint-type", "chat",
            "--streaming", "--concurrency", str(args.concurrency), "--request-count", str(args.request_count),
            "--isl", str(args.isl), "--osl", str(args.osl), "--tokenizer", str(args.tokenizer),
            "--extra-inputs", "ignore_eos:true", "--use-server-token-count", "--warmup-request-count", "4",
            "--artifact-dir", str(artifacts), "--ui-type", "none"]
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    if done.returncode != 0:
        raise SystemExit(f"aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    data = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    return {"ttft_p50_ms": data["time_to_first_token"]["p50"], "itl_p50_ms": data["inter_token_latency"]["p50"],
            "output_tokens_per_s": data["output_token_throughput"]["avg"],
            "prompt_tokens_p50": (data.get("usage_prompt_tokens") or {}).get("p50")}


def run_ours(args: argparse.Namespace, seed: int) -> dict[str, float]:
    # A seed per round: a round must not find the previous round's prompts in the prefix cache.
    workload = WorkloadConfig(system_tokens=0, isl=LengthDist(args.isl), osl=LengthDist(args.osl),
                              turns=LengthDist(1), seed=seed)
    plan = BenchPlan(url=args.url, api=OpenAIChat(args.model, ignore_eos=True), workload=workload,
                     concurrencies=(args.concurrency,), num_requests=args.request_count, warmup=4)
    (level,), _ = asyncio.run(run_bench(plan))
    s = level.summary
    return {"ttft_p50_ms": s.ttft.p50 * 1e3, "tpot_p50_ms": s.tpot.p50 * 1e3, "itl_p50_ms": s.itl.p50 * 1e3,
            "output_tokens_per_s": s.output_tokens_per_s, "prompt_tokens_p50": s.prompt_tokens.p50}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--aiperf", required=True, help="the aiperf executable")
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--export-gguf-tokenizer", type=Path, default=None, metavar="DIR")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--request-count", type=int, default=40)
    parser.add_argument("--isl", type=int, default=200)
    parser.add_argument("--osl", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/aiperf_crosscheck.json"))
    args = parser.parse_args()
    if args.export_gguf_tokenizer:
        args.tokenizer = export_gguf_tokenizer(args.model, args.export_gguf_tokenizer)
    if args.tokenizer is None:
        parser.error("--tokenizer DIR or --export-gguf-tokenizer DIR is required")
    rounds = []
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="aiperf-") as tmp:
        for i in range(args.repeats):
            rounds.append({"aiperf": run_aiperf(args, Path(tmp) / f"r{i}"), "disagg_bench": run_ours(args, seed=i + 1)})
            load.append(os.getloadavg()[0])
    def med(tool, key):
        return statistics.median(r[tool][key] for r in rounds)

    checks = [("TTFT p50", med("aiperf", "ttft_p50_ms"), med("disagg_bench", "ttft_p50_ms")),
              ("ITL p50 (aiperf) vs TPOT p50", med("aiperf", "itl_p50_ms"), med("disagg_bench", "tpot_p50_ms")),
              ("ITL p50 (aiperf) vs chunk ITL p50", med("aiperf", "itl_p50_ms"), med("disagg_bench", "itl_p50_ms"))]
    print(f"{args.url}: chat, c={args.concurrency}, {args.request_count} requests, isl {args.isl}, osl {args.osl}; "
          f"{args.repeats} round(s); load average {', '.join(f'{x:.1f}' for x in load)} on {os.cpu_count()} cpus")
    results = []
    for name, theirs, ours in checks:
        ok = abs(ours / theirs - 1) <= TOLERANCE
        results.append({"figure": name, "aiperf_ms": theirs, "disagg_bench_ms": ours, "ratio": ours / theirs,
                        "pass": ok})
        print(f"{'PASS' if ok else 'FAIL'}: {name}: aiperf {theirs:.1f} ms, disagg bench {ours:.1f} ms "
              f"({ours / theirs:.2f}x; within {TOLERANCE:.0%})")
    print(f"output tok/s: aiperf {med('aiperf', 'output_tokens_per_s'):.1f}, "
          f"disagg bench {med('disagg_bench', 'output_tokens_per_s'):.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds,
                                    "checks": results, "load_average": load}, indent=1))
    print(f"wrote {args.out}")
    return 0 if all(r["pass"] for r in results[:2]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
