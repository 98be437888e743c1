"""Messages between engine rank 0 and its tensor-parallel followers (``rank_link``).

Rank 0 runs the scheduler; before each step's forward it sends every
follower a ``RankStep`` with exactly what the model runner needs (token ids,
positions, block tables, which rows are sampled) and nothing it does not
(no sampling parameters: only rank 0 samples). Followers answer with
``RankHello`` once connected, ``RankReady`` once their shard is loaded,
``RankStepDone`` after each step (synthetic engine only: torch ranks meet in
the step's collectives instead) and ``RankFailed`` before they exit on an
error. Disaggregated KV (``kv_rank_pulls``): a ctx rank 0 tells its followers
which blocks a request parked (``RankPark`` / ``RankUnpark``) so each serves
its own KV heads of them; a gen rank 0 tells each follower what to pull
(``RankPull``, ``RankAbortPull``), and the follower reports ``RankPullDone``.
All frames are HMAC-signed (``workers.ipc.FrameCodec``). Torch-free.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "StepSlice", "RankStep", "RankWelcome", "RankStop", "LeaderMessage",
    "RankHello", "RankReady", "RankStepDone", "RankFailed", "FollowerMessage",
    "RankPark", "RankUnpark", "PullPiece", "RankPull", "RankAbortPull", "RankPullDone", "RankFree",
]


class StepSlice(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One request's share of a step, as ``ScheduledRequest`` names it: the KV of
    ``token_ids`` is computed at ``[start_position, start_position + len(token_ids))``."""

    request_id: int
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    sample: bool
    prompt_logprob_rows: int = 0  # every rank computes those logits too: they join rank 0's gather
    # Always empty: a TP group does not speculate (``LeaderExecutor.verifies_drafts``); here so that
    # every rank picks a step's logit rows with the one ``executor.logit_rows``.
    draft_token_ids: list[int] = msgspec.field(default_factory=list)


class RankStep(msgspec.Struct, frozen=True, tag="step", array_like=True, gc=False):
    step: int
    requests: list[StepSlice]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


class RankWelcome(msgspec.Struct, frozen=True, tag="welcome", array_like=True):
    """Every follower said hello; torch ranks meet at rank 0's store on ``store_port`` (a port rank 0
    bound itself, so no other process can take it between choosing and binding)."""

    store_port: int


class RankStop(msgspec.Struct, frozen=True, tag="stop", array_like=True):
    """Rank 0 is shutting down: exit without an error."""


class RankPark(msgspec.Struct, frozen=True, tag="park", array_like=True):
    ctx_request_id: int
    block_ids: list[int]
    expires_at: float  # unix time: the follower forgets the table then, as rank 0 frees the blocks


class RankUnpark(msgspec.Struct, frozen=True, tag="unpark", array_like=True):
    ctx_request_id: int


class PullPiece(msgspec.Struct, frozen=True, array_like=True):
    """KV heads [ctx_start, ctx_stop) of the ctx rank at ``endpoint`` (its own indices) go to
    this rank's heads [local_start, local_stop)."""

    endpoint: str
    ctx_start: int
    ctx_stop: int
    local_start: int
    local_stop: int


class RankPull(msgspec.Struct, frozen=True, tag="pull", array_like=True):
    pull_id: int  # the gen request id
    ctx_request_id: int
    first_block: int  # of the ctx request's parked table
    block_ids: list[int]  # this worker's blocks (every rank's pool has the same ids)
    pieces: list[PullPiece]


class RankAbortPull(msgspec.Struct, frozen=True, tag="abort_pull", array_like=True):
    """Drop the pull before rank 0 frees its blocks (messages arrive in order: before any step
    that could reuse them)."""

    pull_id: int


class RankFree(msgspec.Struct, frozen=True, tag="free", array_like=True):
    """Rank 0's block manager freed these blocks: a runner that keeps state by block drops it
    (DeepSeek-V4's, ``blocks_freed``). Sent at once, so a later ``RankPull`` or step that reuses
    a block comes after it on the link."""

    block_ids: list[int]


LeaderMessage = RankStep | RankWelcome | RankStop | RankPark | RankUnpark | RankPull | RankAbortPull | RankFree


class RankHello(msgspec.Struct, frozen=True, tag="hello", array_like=True):
    rank: int
    pid: int


class RankReady(msgspec.Struct, frozen=True, tag="ready", array_like=True):
    rank: int
    kv_heads_start: int = 0  # the KV heads this rank's cache holds (torch engine)
    kv_heads_stop: int = 0
    kv_endpoint: str | None = None  # its KV server, for disaggregated pulls of its heads


class RankStepDone(msgspec.Struct, frozen=True, tag="done", array_like=True):
    rank: int
    step: int


class RankFailed(msgspec.Struct, frozen=True, tag="failed", array_like=True):
    rank: int
    error: str


class RankPullDone(msgspec.Struct, frozen=True, tag="pull_done", array_like=True):
    rank: int
    pull_id: int
    error: str | None = None
    num_bytes: int = 0


FollowerMessage = RankHello | RankReady | RankStepDone | RankFailed | RankPullDone
