"""Rank 0's executor in a tensor-parallel group: send the step to the followers, then run it.

``LeaderExecutor`` wraps the rank's own executor (its ``ModelRunner`` shard,
or the synthetic executor). ``execute`` first sends every follower the
step's ``RankStep`` (what the forward needs, no sampling state), then runs
the step itself: torch ranks meet in the forward's all-reduces, and only
rank 0 samples; synthetic followers acknowledge each step, and rank 0 waits
for them so the group stays in lockstep as a real one would. A one-rank
engine never builds this wrapper. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workers.engine.executor import Executor, ExecutorOutput, SchedulerOutput
from workers.rank_link import LeaderLink, RankLost
from workers.rank_protocol import RankFree, RankStep, StepSlice

__all__ = ["LeaderExecutor", "to_rank_step"]

# A synthetic follower only acknowledges: an answer slower than this means it hangs.
SYNTHETIC_ACK_SECONDS = 10.0


def to_rank_step(step: int, batch: SchedulerOutput) -> RankStep:
    requests = [StepSlice(r.request_id, r.token_ids, r.start_position, r.block_ids, r.sample,
                          r.prompt_logprob_rows) for r in batch.requests]
    return RankStep(step, requests, batch.num_prefill_tokens, batch.num_decode_tokens)


class LeaderExecutor:
    """An ``Executor`` whose steps every rank of the group runs."""

    # The followers' forward (``RankStep``) carries no drafts: their logits rows would not match rank 0's.
    verifies_drafts = False

    def __init__(self, inner: Executor, link: LeaderLink, wait_for_acks: bool) -> None:
        self.inner = inner
        self.link = link
        self.wait_for_acks = wait_for_acks
        self.num_steps = 0
        for name in ("eos_token_ids", "vocab_size", "num_blocks", "block_size", "max_model_len", "kv_bytes_per_block"):
            setattr(self, name, getattr(inner, name))
        # The block manager's ``on_free`` hook (``core.py``) only for a runner that keeps state by block.
        if hasattr(inner, "blocks_freed"):
            self.blocks_freed = self._blocks_freed

    def _blocks_freed(self, block_ids: list[int]) -> None:
        self.inner.blocks_freed(block_ids)  # type: ignore[attr-defined]
        self.link.send_all(RankFree(list(block_ids)))

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput:
        self.num_steps += 1
        self.link.send_step(to_rank_step(self.num_steps, batch))
        try:
            output = self.inner.execute(batch)
        except RuntimeError as exc:  # a collective failed: a peer rank died (or hung) mid-step
            raise RankLost(f"a tensor-parallel rank failed mid-step ({type(exc).__name__}: {exc})") from exc
        if self.wait_for_acks:
            self.link.wait_done(self.num_steps, SYNTHETIC_ACK_SECONDS)
        return output

    def export_blocks(self, block_ids: list[int]) -> Sequence[bytes | memoryview]:
        return self.inner.export_blocks(block_ids)

    def import_blocks(self, block_ids: list[int], buffers: list[Any]) -> None:
        self.inner.import_blocks(block_ids, buffers)

    def start_profile(self, trace_dir: str) -> None:
        self.inner.start_profile(trace_dir)

    def stop_profile(self) -> str:
        return self.inner.stop_profile()

    def __getattr__(self, name: str) -> Any:  # e.g. the model runner's sampler, read by tests and stats
        return getattr(self.inner, name)
