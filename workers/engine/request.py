"""The engine-side request and its lifecycle.

States are ordered so that "finished" is a comparison; every transition
happens in the scheduler.
"""

from __future__ import annotations

import enum
from typing import Any

from workers.protocol import FinishReason, RejectReason, TokenLogprobs
from workers.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()  # gen side of disaggregation: blocks allocated, KV in flight
    ONBOARDING = enum.auto()  # blocks allocated, KV being copied back from the host or disk tier
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # blocks freed; recomputed from scratch when rescheduled
    # Everything below is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


# The one table from finished states to API finish reasons.
FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """A request inside the engine: its tokens, progress and block table.

    Range table over ``all_token_ids`` (length ``num_tokens``):
        [0, num_cached_tokens)        hit in the prefix cache at admission
        [0, num_computed_tokens)      KV present in this request's blocks
        [num_computed_tokens, num_tokens)  still to compute (prefill chunk or the
                                      last sampled token during decode)
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "output_token_ids",
        "sampling_params",
        "arrival_time",
        "status",
        "num_computed_tokens",
        "num_cached_tokens",
        "block_ids",
        "first_scheduled_time",
        "first_token_time",
        "num_preemptions",
        "error",
        "reject_reason",
        "grammar",
        "num_unreported_tokens",
        "unreported_logprobs",
        "stop_ids",
        "length_limit",
        "num_remote_tokens",
        "prompt_logprobs",
    )

    def __init__(
        self,
        request_id: int,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float = 0.0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_ids: list[int] = []
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        self.error: str | None = None
        self.reject_reason: RejectReason | None = None  # with ``error``
        # Guided decoding: the llguidance matcher, advanced past every output token
        # (so preemption by recompute keeps it valid); None when unconstrained or finished.
        self.grammar: Any = None
        # Streaming (``stream_interval``): the last ``num_unreported_tokens`` output tokens, and their
        # logprobs, are sampled but not yet in any output.
        self.num_unreported_tokens = 0
        self.unreported_logprobs: list[TokenLogprobs] = []
        # Set at admission (``request_rules.stop_filter``): the token ids that may stop the request and
        # the output count that does; below it, any other token certainly does not.
        self.stop_ids: frozenset[int] = frozenset()
        self.length_limit = 0
        # A request whose KV comes from another engine (``Scheduler.add_remote_request``): the
        # positions [0, num_remote_tokens) are pulled; None for a request computed here alone.
        self.num_remote_tokens: int | None = None
        # Prompt logprobs (``SamplingParams.prompt_logprobs``), collected across prefill chunks: entry
        # ``p`` scores prompt token ``p + 1``. Sent with the first output, then None; None when not asked.
        self.prompt_logprobs: list[TokenLogprobs] | None = (
            [] if sampling_params.prompt_logprobs is not None else None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )
