"""One rank of a DeepSeek-V4 forward over a worker's ranks, run as its own process by test_dsv4_ranks.py.

``python tests/workers/dsv4_rank_forward.py MODEL RANK SIZE PORT OUT`` builds
rank RANK's ``DeepseekV4Runner`` (SIZE 1: the whole model, no process group),
prefills ``rank_prompts()`` in one batch (the longest in two chunks, the cut
off the compression boundaries), then decodes greedily for ``NUM_DECODE``
steps. Rank 0 samples and broadcasts each step's tokens; it writes the
prefill logits, every decode step's logits and the tokens to OUT (.npz).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist
from tp_forward import decode_greedily, join_group  # this script's directory (it runs as a script)

from workers.config import CacheConfig, EngineConfig
from workers.engine.executor import ScheduledRequest, SchedulerOutput
from workers.engine.model.deepseek_v4.runner import DeepseekV4Runner
from workers.sampling_params import SamplingParams

# 300: past the window (128), 75 CSA entries of which the indexer picks 16, 2 HCA entries;
# 170: past the first HCA entry; 45 and 9: inside the window.
LENGTHS = (300, 45, 170, 9)
FIRST_CHUNK = 130  # the 300-token prompt is prefilled as 130 (not a multiple of 4 or 128) + 170
NUM_DECODE = 8
BLOCK_SIZE = 16
BLOCKS_PER_PROMPT = 24


def rank_prompts(vocab_size: int = 512) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, vocab_size, size=n).tolist() for n in LENGTHS]


def main(model: str, rank: int, size: int, port: int, out: str) -> None:
    tp = join_group(rank, size, port, timeout=60.0)
    config = EngineConfig(model=model, device="cpu", cache=CacheConfig(
        block_size=BLOCK_SIZE, num_blocks=len(LENGTHS) * BLOCKS_PER_PROMPT, enable_prefix_caching=False))
    runner = DeepseekV4Runner(config, tp=tp)
    prompts = rank_prompts(runner.vocab_size)
    tables = [list(range(i * BLOCKS_PER_PROMPT, (i + 1) * BLOCKS_PER_PROMPT)) for i in range(len(prompts))]
    params = SamplingParams(temperature=0.0)

    def request(i: int, tokens: list[int], start: int, sample: bool = True) -> ScheduledRequest:
        return ScheduledRequest(i, tokens, start, tables[i], sample, params, 0)

    runner.compute_logits(SchedulerOutput([request(0, prompts[0][:FIRST_CHUNK], 0, sample=False)]))
    batch = [request(0, prompts[0][FIRST_CHUNK:], FIRST_CHUNK)]
    batch += [request(i, p, 0) for i, p in enumerate(prompts) if i > 0]
    batch[1].prompt_logprob_rows = len(prompts[1]) - 1  # prompt logprobs join the vocabulary-parallel gather
    prefill_logits = runner.compute_logits(SchedulerOutput(batch))
    generated, decode_logits = decode_greedily(runner, request, prompts, prefill_logits[: len(prompts)],
                                               NUM_DECODE, rank == 0, tp is not None)
    if rank == 0:
        np.savez(out, prefill_logits=prefill_logits.numpy(), decode_logits=torch.stack(decode_logits).numpy(),
                 tokens=np.array(generated))
    if tp is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
