"""One request against the memory-bandwidth limit: TTFT, decode tokens/s, and the physical ceiling.

A decode step of one request reads every weight once (the tied embedding as
lm_head too), so it cannot beat ``bandwidth / weight bytes`` tokens/s. The
bandwidth is measured in the same run: the best of a few passes of a
read-only reduction and a copy over a buffer far larger than the caches.
"""

from __future__ import annotations

import time

import torch

from workers.engine.core import EngineCore
from workers.protocol import EngineRequest
from workers.sampling_params import SamplingParams

BUFFER_BYTES = 1 << 30


def weight_bytes(core: EngineCore) -> int:
    """Bytes of weights one decode step reads, from the model's shape (packed linears are not parameters):
    every projection, and the vocabulary matrix once (lm_head; the embedding lookup reads one row)."""
    config = core.executor.model_config
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = (config.hidden_size * (q_size + 2 * kv_size) + q_size * config.hidden_size
                 + 3 * config.hidden_size * config.intermediate_size + 2 * config.hidden_size)
    num_weights = config.num_layers * per_layer + config.vocab_size * config.hidden_size + config.hidden_size
    return num_weights * core.executor.kv_cache.storage.element_size()  # the engine's dtype


def memory_bandwidth(repeats: int = 5) -> dict[str, float]:
    """Bytes/s of a read-only sum and of a copy (read + write) over a 1 GiB buffer, best of ``repeats``."""
    source = torch.ones(BUFFER_BYTES // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    read, copy = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        source.sum()
        read.append(BUFFER_BYTES / (time.perf_counter() - start))
        start = time.perf_counter()
        target.copy_(source)
        copy.append(2 * BUFFER_BYTES / (time.perf_counter() - start))
    return {"read_bytes_per_s": max(read), "copy_bytes_per_s": max(copy)}


def single_request(core: EngineCore, prompt: list[int], max_tokens: int, request_id: int) -> dict[str, float]:
    """TTFT and decode tokens/s (after the first token) of one request alone on the engine."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    core.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params))
    first, num_tokens = None, 0
    while core.has_unfinished():
        for out in core.step():
            num_tokens += len(out.new_token_ids)
            if first is None and out.new_token_ids:
                first = time.perf_counter()
    end = time.perf_counter()
    return {"prompt_tokens": len(prompt), "ttft_ms": 1e3 * (first - start),
            "decode_tokens_per_s": (num_tokens - 1) / (end - first)}


def decode_against_limit(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Best TTFT and decode rate over ``prompts`` (distinct: no prefix-cache hits), one at a time."""
    single_request(core, prompts[0][:8], 4, request_id=10_000)  # warm-up
    runs = [single_request(core, prompt, max_tokens, request_id=10_001 + i) for i, prompt in enumerate(prompts[1:])]
    best = {"prompt_tokens": len(prompts[1]), "ttft_ms": min(r["ttft_ms"] for r in runs),
            "decode_tokens_per_s": max(r["decode_tokens_per_s"] for r in runs)}
    bandwidth = memory_bandwidth()
    limit_bandwidth = max(bandwidth.values())
    num_bytes = weight_bytes(core)
    limit = limit_bandwidth / num_bytes
    return {**best, "max_tokens": max_tokens, "weight_bytes_per_token": num_bytes, **bandwidth,
            "physical_limit_tokens_per_s": limit, "fraction_of_limit": best["decode_tokens_per_s"] / limit}
