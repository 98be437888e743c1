"""Engine throughput and TTFT, CPU: the bench-size tiny model, or a real one (``--model``).

Measured in one run, so the ratios hold on a shared, noisy machine:
  1. output tokens/s of EngineCore for 32 concurrent requests (prompts of
     64..512 tokens, 128 output tokens each), against Hugging Face
     ``generate`` on the same checkpoint with the same requests (one batch,
     left padding, greedy, float32). Engine and HF run alternately for
     ``--rounds`` rounds; the reported ratio is the median of the per-round
     ratios, so a burst of load from other processes spoils one round, not
     the figure. Target: >= 2x.
  2. time to first token of a request whose prompt shares 90% with a
     finished one, against the same prompt on a cold cache, for 512- and
     2048-token prompts. Target: <= 0.25x.
  3. with ``--model`` (a short name, a model directory or a .gguf file, e.g.
     ``smollm2-135m-instruct``) in place of 2.: one request's TTFT and decode
     tokens/s against the physical limit, memory bandwidth (measured in the
     same run) over the weight bytes read per token (``decode_limit``).
     transformers loads the same file (``gguf_file=``) for 1.

    python benchmarks/engine_throughput.py [--model NAME] [--out FILE] [--rounds 5] [--threads N]
        [--decode-attention auto|native|sdpa] [--emulate-isa avx2] [--skip-prefix-ttft]

``--emulate-isa avx2`` runs engine and transformers as on an AVX2-only x86
CPU (torch, oneDNN, MKL and the native kernel limited to AVX2; see
``cpu_isa``); the extensions in effect are printed beside the ratio and
written to the JSON either way.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from cpu_isa import EMULATIONS, describe, emulate, vector_extensions
from decode_limit import decode_against_limit

from workers.config import DECODE_ATTENTION_MODES, CacheConfig, EngineConfig, SchedulerConfig
from workers.engine.core import EngineCore
from workers.engine.model.tiny import make_tiny_model
from workers.protocol import EngineRequest
from workers.sampling_params import SamplingParams


def make_prompts(num: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids past the first few keep clear of special tokens at the low end.
    return [[rng.randrange(16, vocab_size - 16) for _ in range(rng.randint(64, 512))] for _ in range(num)]


def engine_config(
    model_dir: Path, num_blocks: int, max_model_len: int | None = None, decode_attention: str = "auto"
) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        device="cpu",
        decode_attention=decode_attention,
        max_model_len=max_model_len,
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
    ).validate()


def run_engine(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(EngineRequest(request_id=i, prompt_token_ids=ids, sampling_params=params))
    num_tokens = 0
    start = time.perf_counter()
    while core.has_unfinished():
        num_tokens += sum(len(out.new_token_ids) for out in core.step())
    return time.perf_counter() - start, num_tokens


def load_hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if model_dir.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(model_dir.parent, gguf_file=model_dir.name,
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def run_hf_generate(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompts):  # left padding, as generate expects for decoder-only models
        input_ids[row, longest - len(ids) :] = torch.tensor(ids)
        attention_mask[row, longest - len(ids) :] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    elapsed = time.perf_counter() - start
    return elapsed, int((out.shape[1] - longest) * len(prompts))


def time_to_first_token(core: EngineCore, request_id: int, prompt: list[int]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    core.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params))
    while True:
        if any(out.request_id == request_id and out.new_token_ids for out in core.step()):
            elapsed = time.perf_counter() - start
            break
    while core.has_unfinished():
        core.step()
    return elapsed


def prefix_ttft(
    model_dir: Path, vocab_size: int, prompt_len: int, repeats: int, decode_attention: str
) -> dict[str, float]:
    """Best-of-``repeats`` TTFT of a prompt sharing 90% with a finished one, hit vs cold cache."""
    rng = random.Random(prompt_len)
    num_blocks = 4 * prompt_len // 16 + 16  # both prompts and the warm-up, with room to spare
    max_model_len = max(prompt_len + 16, 2048)  # past the checkpoint's 2048 for the long prompt
    warm, cold = [], []
    for _ in range(repeats):
        first = [rng.randrange(16, vocab_size - 16) for _ in range(prompt_len)]
        shared = int(len(first) * 0.9)
        second = first[:shared] + [rng.randrange(16, vocab_size - 16) for _ in range(len(first) - shared)]
        core = EngineCore(engine_config(model_dir, num_blocks, max_model_len, decode_attention))
        time_to_first_token(core, 0, first[:16])  # warm the kernels up, not the prefix
        cold.append(time_to_first_token(core, 1, second))
        core = EngineCore(engine_config(model_dir, num_blocks, max_model_len, decode_attention))
        time_to_first_token(core, 0, first[:16])
        time_to_first_token(core, 1, first)
        warm.append(time_to_first_token(core, 2, second))
    cold_ms, warm_ms = 1e3 * min(cold), 1e3 * min(warm)
    ratio = warm_ms / cold_ms
    return {"prompt_len": prompt_len, "ttft_cold_ms": cold_ms, "ttft_prefix_hit_ms": warm_ms, "ratio": ratio}


def throughput_rounds(
    model_dir: Path,
    prompts: list[list[int]],
    warm_up: list[list[int]],
    max_tokens: int,
    num_rounds: int,
    decode_attention: str,
) -> list[dict[str, float]]:
    """Engine, then HF, ``num_rounds`` times: each round's rates, ratio and the load before it."""
    hf_model = load_hf_model(model_dir)
    run_hf_generate(hf_model, warm_up, 4)
    rounds = []
    for index in range(num_rounds):
        # A fresh engine each round: the last round's blocks would be prefix-cache hits.
        core = EngineCore(engine_config(model_dir, 2048, decode_attention=decode_attention))
        run_engine(core, warm_up, 4)
        load = os.getloadavg()[0]
        cpu_start = time.process_time()
        engine_s, engine_tokens = run_engine(core, prompts, max_tokens)
        engine_cpu_s, cpu_start = time.process_time() - cpu_start, time.process_time()
        hf_s, hf_tokens = run_hf_generate(hf_model, prompts, max_tokens)
        hf_cpu_s = time.process_time() - cpu_start
        engine_rate, hf_rate = engine_tokens / engine_s, hf_tokens / hf_s
        rounds.append(
            {
                "load_avg_1min": load,
                "engine_s": engine_s,
                "engine_tokens_per_s": engine_rate,
                "hf_s": hf_s,
                "hf_generate_tokens_per_s": hf_rate,
                "ratio": engine_rate / hf_rate,
                "cpu_ratio": (hf_cpu_s / hf_tokens) / (engine_cpu_s / engine_tokens),
                # CPU seconds of this process: with one thread, a steadier figure under load than wall time.
                "engine_cpu_s": engine_cpu_s,
                "hf_cpu_s": hf_cpu_s,
            }
        )
        print(
            f"round {index}: load {load:4.2f}  engine {engine_rate:7.1f} tok/s ({engine_s:.2f} s)"
            f"  hf {hf_rate:7.1f} tok/s ({hf_s:.2f} s)  ratio {engine_rate / hf_rate:.2f}x"
            f"  (cpu s: engine {engine_cpu_s:.2f}, hf {hf_cpu_s:.2f})",
            flush=True,
        )
    return rounds


def bench_model(args: argparse.Namespace) -> tuple[Path, int]:
    """The model to measure (``--model``, else the bench-size tiny model) and its vocabulary size."""
    if args.model:
        from disagg.model_names import resolve_model
        from workers.engine.model.gguf_metadata import gguf_vocab_size, is_gguf_file, open_gguf

        path = resolve_model(args.model)
        if is_gguf_file(path):
            return path, gguf_vocab_size(open_gguf(path))
        return path, json.loads((path / "config.json").read_text())["vocab_size"]
    model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="disagg-bench-")) / "tiny-bench"
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, size="bench")
    return model_dir, json.loads((model_dir / "config.json").read_text())["vocab_size"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="default: benchmarks/results/engine_throughput[-MODEL].json")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="engine/HF rounds; the ratio is their median")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--model-dir", default=None,
                        help="where to write the bench-size tiny model (default: a tmp dir)")
    parser.add_argument("--model", default=None, help="a real model instead: a short name (smollm2-135m-instruct), "
                                                      "a model directory or a .gguf file")
    parser.add_argument("--decode-attention", default="auto", choices=DECODE_ATTENTION_MODES,
                        help="the engine's decode attention (EngineConfig.decode_attention)")
    parser.add_argument("--emulate-isa", default=None, choices=sorted(EMULATIONS),
                        help="run as on a CPU with no more than these vector extensions (re-executes itself)")
    parser.add_argument("--skip-prefix-ttft", action="store_true", help="measure the throughput ratio only")
    args = parser.parse_args()
    emulate(args.emulate_isa)
    extensions = vector_extensions()
    print(describe(extensions), flush=True)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir, vocab_size = bench_model(args)
    prompts = make_prompts(args.num_requests, vocab_size)

    warm_up = make_prompts(2, vocab_size, seed=1)  # not the measured prompts: no prefix-cache hits
    rounds = throughput_rounds(model_dir, prompts, warm_up, args.max_tokens, args.rounds, args.decode_attention)
    ratio = statistics.median(r["ratio"] for r in rounds)
    cpu_ratio = statistics.median(r["cpu_ratio"] for r in rounds)
    if args.model:
        core = EngineCore(engine_config(model_dir, 256, decode_attention=args.decode_attention))
        rng = random.Random(2)  # four distinct 128-token prompts: a warm-up and three measured
        prompts_128 = [[rng.randrange(16, vocab_size - 16) for _ in range(128)] for _ in range(4)]
        single = decode_against_limit(core, prompts_128, args.max_tokens)
        ttft = []
    elif args.skip_prefix_ttft:
        ttft = []
    else:
        ttft = [prefix_ttft(model_dir, vocab_size, 512, 5, args.decode_attention),
                prefix_ttft(model_dir, vocab_size, 2048, 3, args.decode_attention)]

    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "threads_option": args.threads,
            "decode_attention": args.decode_attention,
            "emulate_isa": args.emulate_isa,
            "vector_extensions": extensions,
        },
        "throughput": {
            "num_requests": args.num_requests,
            "max_tokens": args.max_tokens,
            "engine_tokens_per_s": statistics.median(r["engine_tokens_per_s"] for r in rounds),
            "hf_generate_tokens_per_s": statistics.median(r["hf_generate_tokens_per_s"] for r in rounds),
            "ratio": ratio,
            "ratio_is": "median of per-round ratios",
            "cpu_ratio": cpu_ratio,
            "cpu_ratio_is": "median of per-round (HF CPU-s per token) / (engine CPU-s per token)",
            "rounds": rounds,
            "target_ratio": 2.0,
        },
    }
    if args.model:
        result["model"] = {"name": args.model, "path": str(model_dir)}
        result["single_request"] = single
        print(f"one request: TTFT {single['ttft_ms']:.1f} ms ({single['prompt_tokens']}-token prompt), decode "
              f"{single['decode_tokens_per_s']:.1f} tok/s = {100 * single['fraction_of_limit']:.0f}% of the "
              f"physical limit {single['physical_limit_tokens_per_s']:.1f} tok/s "
              f"({single['weight_bytes_per_token'] / 1e6:.0f} MB of weights per token at "
              f"{max(single['read_bytes_per_s'], single['copy_bytes_per_s']) / 1e9:.1f} GB/s)")
    elif ttft:
        result["prefix_ttft"] = {**ttft[0], "target_ratio": 0.25}
        result["prefix_ttft_long"] = {**ttft[1], "target_ratio": 0.25}
    print(f"ratio        {ratio:8.2f}x median of {len(rounds)} rounds (target >= 2x)"
          f"  [torch {extensions['torch_capability']}, oneDNN {extensions['onednn_isa']}]")
    print(f"cpu ratio    {cpu_ratio:8.2f}x median of {len(rounds)} rounds (transformers CPU-s per token"
          " / the engine's, this process)")
    print(f"{'PASS' if ratio >= 2.0 else 'FAIL'} engine/transformers >= 2x")
    for entry in ttft:
        print(
            f"TTFT {entry['prompt_len']}-token prompt, 90% shared prefix {entry['ttft_prefix_hit_ms']:.1f} ms"
            f" vs cold {entry['ttft_cold_ms']:.1f} ms: {entry['ratio']:.2f}x (target <= 0.25x)"
        )
    suffix = f"-{Path(args.model).name}" if args.model else ""
    out = Path(args.out or f"benchmarks/results/engine_throughput{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
