"""One rank of a tensor-parallel forward, run as its own process by test_tp_model.py.

``python tests/workers/tp_forward.py MODEL RANK SIZE PORT OUT`` loads rank
RANK's shard (SIZE 1: the whole model, no process group), prefills the
prompts of ``tp_prompts()`` in one batch, then decodes greedily for
``NUM_DECODE`` steps. Rank 0 samples and broadcasts each step's tokens as a
tensor; rank 0 writes the prefill logits and the tokens to OUT (.npz).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from workers.config import CacheConfig, EngineConfig
from workers.engine.executor import ScheduledRequest, SchedulerOutput
from workers.engine.model.parallel import TensorParallel, init_process_group, tcp_store
from workers.engine.model_runner import ModelRunner
from workers.sampling_params import SamplingParams

NUM_PROMPTS = 20
NUM_DECODE = 8
BLOCK_SIZE = 16
BLOCKS_PER_PROMPT = 4


def tp_prompts(vocab_size: int = 512) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, vocab_size, size=int(rng.integers(3, 40))).tolist() for _ in range(NUM_PROMPTS)]


def join_group(rank: int, size: int, port: int, timeout: float = 30.0) -> TensorParallel | None:
    """This rank's place in the gloo group of ``size`` ranks meeting at 127.0.0.1:``port`` (None for one)."""
    torch.set_num_threads(1)
    if size == 1:
        return None
    store = tcp_store("127.0.0.1", port, size, rank == 0, timeout)
    return init_process_group(rank, size, store, torch.device("cpu"), timeout)


def main(model: str, rank: int, size: int, port: int, out: str) -> None:
    tp = join_group(rank, size, port)
    config = EngineConfig(model=model, device="cpu", cache=CacheConfig(block_size=BLOCK_SIZE,
                                                                       num_blocks=NUM_PROMPTS * BLOCKS_PER_PROMPT))
    runner = ModelRunner(config, tp=tp)
    prompts = tp_prompts(runner.vocab_size)
    tables = [list(range(i * BLOCKS_PER_PROMPT, (i + 1) * BLOCKS_PER_PROMPT)) for i in range(NUM_PROMPTS)]
    params = SamplingParams(temperature=0.0)

    def request(i: int, tokens: list[int], start: int) -> ScheduledRequest:
        return ScheduledRequest(i, tokens, start, tables[i], True, params, 0)

    batch = [request(i, p, 0) for i, p in enumerate(prompts)]
    # The first prompt asks for prompt logprobs: its positions' logits follow the sampled rows (every
    # rank computes them: they join the vocabulary-parallel gather).
    batch[0].prompt_logprob_rows = len(prompts[0]) - 1
    prefill_logits = runner.compute_logits(SchedulerOutput(batch))
    generated, _ = decode_greedily(runner, request, prompts, prefill_logits[:NUM_PROMPTS], NUM_DECODE,
                                   rank == 0, tp is not None)
    if rank == 0:
        np.savez(out, prefill_logits=prefill_logits.numpy(), tokens=np.array(generated))
    if tp is not None:
        dist.destroy_process_group()


def decode_greedily(runner: Any, request: Callable[[int, list[int], int], ScheduledRequest], prompts: list[list[int]],
                    logits: torch.Tensor, num_steps: int, is_rank0: bool, grouped: bool
                    ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """From the prompts' last logits, ``num_steps`` batched greedy decode steps on every rank: rank 0 picks
    and broadcasts the tokens. Each prompt's tokens (``num_steps`` + 1) and each step's logits (rank 0's)."""
    generated: list[list[int]] = [[] for _ in prompts]
    step_logits = []
    for step in range(num_steps + 1):
        tokens = logits.argmax(dim=-1) if is_rank0 else torch.empty(len(prompts), dtype=torch.long)
        if grouped:
            dist.broadcast(tokens, src=0)
        for i, token in enumerate(tokens.tolist()):
            generated[i].append(token)
        if step == num_steps:
            break
        batch = [request(i, [generated[i][-1]], len(p) + step) for i, p in enumerate(prompts)]
        logits = runner.compute_logits(SchedulerOutput(batch))
        step_logits.append(logits)
    return generated, step_logits


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
