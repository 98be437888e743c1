"""Decode speed of the engine's DeepSeek-V4 model code against transformers' ``generate``, same checkpoint, same run.

Writes the tiny DeepSeek-V4 checkpoint (``make_tiny_dsv4``), prefills ``--batch``
prompts of ``--prompt-tokens`` random tokens, then times ``--new-tokens`` greedy
cached decode steps of all sequences at once (``DeepseekV4Model.forward`` with a
``SequenceState`` per sequence) and transformers' ``generate`` (greedy, its own
cache) over the same prompts. Reports decode tokens/s of each: ours from the
decode steps' wall clock, transformers' from ``generate``'s less a separately
timed forward over the prompts (its prefill). Needs the dev extra.

    python benchmarks/dsv4_decode.py [--batch 1 16] [--prompt-tokens 200] [--new-tokens 32] [--threads 1]
"""

from __future__ import annotations

import argparse
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


def _transformers(model_dir: Path, prompts: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        start = time.perf_counter()
        model(prompts)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
    # generate's time less a separately timed prefill of the same prompts: its decode steps alone.
    return prompts.shape[0] * new_tokens / (time.perf_counter() - start - prefill), prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads of both (default: torch's own)")
    args = parser.parse_args()
    if args.threads is not None:  # on a shared machine, spinning thread pools dominate tiny ops
        torch.set_num_threads(args.threads)
    from workers.engine.model.tiny_dsv4 import make_tiny_dsv4

    model_dir = make_tiny_dsv4(Path(tempfile.mkdtemp(prefix="dsv4-bench-")) / "tiny")
    for batch in args.batch:
        prompts = torch.randint(0, 512, (batch, args.prompt_tokens), generator=torch.Generator().manual_seed(batch))
        ours = _ours(model_dir, prompts, args.new_tokens)
        theirs, their_prefill = _transformers(model_dir, prompts, args.new_tokens)
        print(
            f"batch {batch:3d}: engine {ours:8.1f} tok/s   transformers generate {theirs:8.1f} tok/s "
            f"(less its prefill of {their_prefill:.2f}s)   ratio {ours / theirs:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
