"""``disagg generate``: complete prompts with an in-process engine (the local demo).

Tokenizes with the model's tokenizer (``tokenizer.json`` or GGUF metadata), runs every prompt through one
``EngineCore`` (continuous batching), prints each completion and the rate.
"""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_PROMPTS = (
    "The quick brown fox",
    "def fibonacci(n):",
    "Disaggregated serving splits prefill and decode so that",
)


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a Hugging Face model directory (see make-tiny-model), a .gguf file or a "
                                      "short model name (smollm2-135m-instruct)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: three demo prompts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None)


def run_generate(args: argparse.Namespace) -> int:
    from api.tokenizer import Tokenizer
    from disagg.model_names import ModelNotFoundError, resolve_model
    from workers.config import CacheConfig, EngineConfig
    from workers.engine.core import EngineCore
    from workers.protocol import EngineRequest
    from workers.sampling_params import SamplingParams

    try:
        model_dir = resolve_model(args.model)
    except ModelNotFoundError as exc:
        print(f"disagg generate: {exc}", file=sys.stderr)
        return 2
    tokenizer = Tokenizer.from_model_path(model_dir)
    config = EngineConfig(
        model=str(model_dir),
        dtype=args.dtype,
        device=args.device,
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks),
    ).validate()
    core = EngineCore(config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    params.validate()

    prompts = args.prompt or list(DEFAULT_PROMPTS)
    outputs: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        core.add_request(EngineRequest(request_id=i, prompt_token_ids=ids, sampling_params=params))
        outputs[i] = []

    start = time.perf_counter()
    num_steps = 0
    while core.has_unfinished():
        for out in core.step():
            if out.error:
                print(f"[{out.request_id}] rejected: {out.error}")
            outputs[out.request_id].extend(out.new_token_ids)
        num_steps += 1
    elapsed = time.perf_counter() - start

    for i, prompt in enumerate(prompts):
        print(f"[{i}] {prompt!r} -> {tokenizer.decode(outputs[i])!r}")
    num_tokens = sum(len(t) for t in outputs.values())
    print(f"{num_tokens} tokens in {num_steps} steps, {elapsed:.2f} s ({num_tokens / max(elapsed, 1e-9):.0f} tokens/s)")
    return 0
