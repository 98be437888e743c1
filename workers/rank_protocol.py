"""Messages between engine rank 0 and its tensor-parallel followers (``rank_link``).

Rank 0 runs the scheduler; before each step's forward it sends every
follower a ``RankStep`` with exactly what the model runner needs (token ids,
positions, block tables, which rows are sampled) and nothing it does not
(no sampling parameters: only rank 0 samples). Followers answer with
``RankHello`` once connected, ``RankReady`` once their shard is loaded,
``RankStepDone`` after each step (synthetic engine only: torch ranks meet in
the step's collectives instead) and ``RankFailed`` before they exit on an
error. All frames are HMAC-signed (``workers.ipc.FrameCodec``). Torch-free.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "StepSlice", "RankStep", "RankStop", "LeaderMessage",
    "RankHello", "RankReady", "RankStepDone", "RankFailed", "FollowerMessage",
]


class StepSlice(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One request's share of a step, as ``ScheduledRequest`` names it: the KV of
    ``token_ids`` is computed at ``[start_position, start_position + len(token_ids))``."""

    request_id: int
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    sample: bool


class RankStep(msgspec.Struct, frozen=True, tag="step", array_like=True, gc=False):
    step: int
    requests: list[StepSlice]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


class RankStop(msgspec.Struct, frozen=True, tag="stop", array_like=True):
    """Rank 0 is shutting down: exit without an error."""


LeaderMessage = RankStep | RankStop


class RankHello(msgspec.Struct, frozen=True, tag="hello", array_like=True):
    rank: int
    pid: int


class RankReady(msgspec.Struct, frozen=True, tag="ready", array_like=True):
    rank: int
    kv_heads_start: int = 0  # the KV heads this rank's cache holds (torch engine)
    kv_heads_stop: int = 0


class RankStepDone(msgspec.Struct, frozen=True, tag="done", array_like=True):
    rank: int
    step: int


class RankFailed(msgspec.Struct, frozen=True, tag="failed", array_like=True):
    rank: int
    error: str


FollowerMessage = RankHello | RankReady | RankStepDone | RankFailed
