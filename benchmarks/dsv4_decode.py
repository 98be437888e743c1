"""Decode speed of the engine's DeepSeek-V4 model code against transformers' ``generate``, same checkpoint, same run.

Writes the tiny DeepSeek-V4 checkpoint (``make_tiny_dsv4``), prefills ``--batch``
prompts of ``--prompt-tokens`` random tokens, then times ``--new-tokens`` greedy
cached decode steps of all sequences at once (``DeepseekV4Model.forward`` with a
``SequenceState`` per sequence) and transformers' cached greedy decode
(``DeepseekV4ForCausalLM`` with its own cache, the steps ``generate`` takes)
over the same prompts. Reports decode tokens/s of each from the decode steps'
wall clock, in ``--rounds`` interleaved rounds: the median ratio and its
spread. Needs the dev extra.

    python benchmarks/dsv4_decode.py [--batch 1 16] [--prompt-tokens 200] [--new-tokens 32] [--threads 1]
        [--rounds 3] [--out benchmarks/results/dsv4_decode.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _ours(model_dir: Path, prompts: torch.Tensor, new_tokens: int) -> float:
    from workers.engine.model.deepseek_v4.model import DeepseekV4Model, SequenceBatch

    model = DeepseekV4Model.from_dir(model_dir)
    states = [model.new_state() for _ in prompts]
    logits = model.forward(prompts.flatten(), [SequenceBatch(s, prompts.shape[1]) for s in states])
    last = logits.view(prompts.shape[0], prompts.shape[1], -1)[:, -1]
    start = time.perf_counter()
    for _ in range(new_tokens):
        last = model.forward(last.argmax(-1), [SequenceBatch(s, 1) for s in states])
    return prompts.shape[0] * new_tokens / (time.perf_counter() - start)


def _transformers(model_dir: Path, prompts: torch.Tensor, new_tokens: int) -> float:
    """transformers' own cached greedy decode, step by step as ``generate`` runs it, minus
    ``generate``'s bookkeeping: the decode steps alone are timed, as ours are."""
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(prompts, use_cache=True)
        cache, last = out.past_key_values, out.logits[:, -1]
        start = time.perf_counter()
        for _ in range(new_tokens):
            out = model(last.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True)
            cache, last = out.past_key_values, out.logits[:, -1]
        return prompts.shape[0] * new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of both (default: torch's own)")
    args = parser.parse_args()
    if args.threads is not None:  # on a shared machine, spinning thread pools dominate tiny ops
        torch.set_num_threads(args.threads)
    from workers.engine.model.tiny_dsv4 import make_tiny_dsv4

    model_dir = make_tiny_dsv4(Path(tempfile.mkdtemp(prefix="dsv4-bench-")) / "tiny")
    results = []
    for batch in args.batch:
        prompts = torch.randint(0, 512, (batch, args.prompt_tokens), generator=torch.Generator().manual_seed(batch))
        rounds = []
        for _ in range(args.rounds):  # interleaved: a load change touches both sides of a round alike
            rounds.append(
                (_ours(model_dir, prompts, args.new_tokens), _transformers(model_dir, prompts, args.new_tokens))
            )
        ratios = sorted(ours / theirs for ours, theirs in rounds)
        median = statistics.median(ratios)
        print(
            f"batch {batch:3d}: engine {statistics.median(r[0] for r in rounds):8.1f} tok/s   transformers "
            f"{statistics.median(r[1] for r in rounds):8.1f} tok/s   ratio median {median:.2f}x "
            f"(min {ratios[0]:.2f}, max {ratios[-1]:.2f}, {args.rounds} rounds)",
            flush=True,
        )
        results.append(
            {
                "batch": batch,
                "rounds": [{"engine": o, "transformers": t} for o, t in rounds],
                "ratio_median": median,
                "ratio_min": ratios[0],
                "ratio_max": ratios[-1],
            }
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "prompt_tokens": args.prompt_tokens,
                    "new_tokens": args.new_tokens,
                    "threads": args.threads,
                    "batches": results,
                },
                indent=2,
            )
        )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
