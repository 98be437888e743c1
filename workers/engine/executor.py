"""The contract between the scheduler and whatever computes tokens.

The scheduler decides *what* runs in a step (``SchedulerOutput``); an
executor computes it and samples (``ExecutorOutput``). Two executors exist:
``workers.engine.model_runner.ModelRunner`` (torch, the real model) and
``workers.engine.synthetic.SyntheticExecutor`` (a timing model, no torch).
Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from workers.protocol import TokenLogprobs
from workers.sampling_params import SamplingParams


class ScheduledRequest(msgspec.Struct, gc=False):
    """One request's share of a step (one per request per step: a Struct, whose C
    constructor costs a fraction of a dataclass's; it never crosses a socket).

    ``token_ids`` are the tokens whose KV is computed this step, at positions
    ``[start_position, start_position + len(token_ids))``. ``block_ids`` is
    the request's whole block table (covering every position up to the end
    of this chunk; the request's live list: read it during ``execute`` only). ``sample`` is true when this chunk ends at the last known
    token, so the step produces the request's next token; a non-final prefill
    chunk only fills the cache.
    ``num_output_tokens`` is the output position of the token to be sampled,
    which together with ``sampling_params.seed`` seeds the sampler.
    """

    request_id: int
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams
    num_output_tokens: int
    # Tokens generated so far and the prompt (live lists, read-only), for the
    # sampler's penalties.
    output_token_ids: list[int] = msgspec.field(default_factory=list)
    prompt_token_ids: list[int] = msgspec.field(default_factory=list)
    # The request's llguidance matcher (guided decoding), None when unconstrained.
    # The sampler only reads it; the scheduler advances it with each accepted token.
    grammar: Any = None
    # Prompt logprobs (``SamplingParams.prompt_logprobs``): the logits of this chunk's first
    # ``prompt_logprob_rows`` positions are computed too, each scoring the prompt token after it.
    # 0 for every other entry: the common step computes the sampled rows' logits only.
    prompt_logprob_rows: int = 0
    # Speculative decoding (``workers.engine.speculative``): the drafts, the last ``len(draft_token_ids)``
    # of ``token_ids``. The executor samples after every one of them and keeps the accepted ones.
    draft_token_ids: list[int] = msgspec.field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """Everything one step computes, prefills and decodes mixed, in order."""

    requests: list[ScheduledRequest]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # Blocks copied back from the host or disk tier for the requests this step admits (copied
    # already, off the step; the synthetic timing model charges them: ``synthetic.step_seconds``).
    num_onboarded_blocks: int = 0
    num_draft_tokens: int = 0  # speculative drafts among the decode tokens
    # The scheduler's own object of each entry of ``requests`` (its ``Request``), in the same order:
    # its update reads them back without a lookup by id per request per step. Executors ignore it.
    owners: list[Any] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class SampledToken(msgspec.Struct, gc=False):
    """One sampled token and its logprobs, as the torch sampler returns them."""

    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass(slots=True)
class ExecutorOutput:
    """What a step sampled, entry by entry in the batch's order (``SchedulerOutput.requests``).

    ``token_ids[i]`` is entry i's sampled token, None where its ``sample`` is false (a non-final
    prefill chunk); ``logprobs`` is None unless an entry asked for them, then ``logprobs[i]`` is
    entry i's (None where not asked). Plain lists read back by position: an object and a dict
    entry per request per step cost the synthetic engine a tenth of its step.
    """

    token_ids: list[int | None]
    logprobs: list[TokenLogprobs | None] | None = None
    # None unless an entry has ``prompt_logprob_rows``; then entry i's prompt tokens' logprobs (one
    # per row, the token after each row's position), None where it has none.
    prompt_logprobs: list[list[TokenLogprobs] | None] | None = None
    # Speculative decoding: None when no entry had drafts, else per entry the further tokens its step
    # yields after ``token_ids[i]``, in order (``speculative.accepted``); [] for an entry without drafts.
    more_token_ids: list[list[int]] | None = None

    @classmethod
    def of(cls, batch: SchedulerOutput, sampled: Sequence[SampledToken],
           prompt_logprobs: list[list[TokenLogprobs] | None] | None = None) -> ExecutorOutput:
        """From the sampled tokens of the batch's entries with ``sample`` set, in order."""
        token_ids: list[int | None] = [None] * len(batch.requests)
        logprobs: list[TokenLogprobs | None] | None = None
        tokens = iter(sampled)
        for i, scheduled in enumerate(batch.requests):
            if scheduled.sample:
                token = next(tokens)
                token_ids[i] = token.token_id
                if token.logprobs is not None:
                    if logprobs is None:
                        logprobs = [None] * len(batch.requests)
                    logprobs[i] = token.logprobs
        return cls(token_ids, logprobs, prompt_logprobs)


class StepRows(Protocol):
    """What choosing a step's logit rows reads of an entry (``ScheduledRequest``, ``StepSlice``)."""

    token_ids: list[int]
    sample: bool
    prompt_logprob_rows: int
    draft_token_ids: list[int]


def logit_rows(requests: Sequence[StepRows]) -> list[int]:
    """The rows of a step's flattened tokens whose logits the step returns: each sampled entry's
    last token (and its drafts, ``draft_token_ids``), in order, then each entry's
    ``prompt_logprob_rows`` first tokens, in order (``workers.engine.sampler.sample_step`` splits
    them there)."""
    sampled: list[int] = []
    prompt: list[int] = []
    offset = 0
    for request in requests:
        num_tokens = len(request.token_ids)
        if request.sample:  # the last token's row; with drafts, each draft's too (verified together)
            sampled.extend(range(offset + num_tokens - 1 - len(request.draft_token_ids), offset + num_tokens))
        if request.prompt_logprob_rows:
            prompt.extend(range(offset, offset + request.prompt_logprob_rows))
        offset += num_tokens
    return sampled + prompt


class Executor(Protocol):
    """Computes scheduled tokens into the paged KV cache and samples."""

    eos_token_ids: frozenset[int]
    vocab_size: int
    num_blocks: int  # KV blocks the executor allocated (from CacheConfig)
    block_size: int
    max_model_len: int  # EngineConfig.max_model_len, or the model's own limit
    kv_bytes_per_block: int  # what ``export_blocks`` sends per block: sizes KV-transfer messages

    def execute(self, batch: SchedulerOutput) -> ExecutorOutput: ...

    def export_blocks(self, block_ids: list[int]) -> Sequence[bytes | memoryview]:
        """The KV of ``block_ids`` (all layers, K and V) as the executor's wire frames.

        The frames' number and layout are the executor's own; they may be
        memoryviews over the KV pool, sent as zero-copy frames, so they are
        valid while the blocks are not written (parked blocks never are)."""
        ...

    def import_blocks(self, block_ids: list[int], buffers: list[bytes]) -> None:
        """Write the frames ``export_blocks`` of an identical model gave for as many blocks into ``block_ids``."""
        ...

    def start_profile(self, trace_dir: str) -> None: ...

    def stop_profile(self) -> str: ...

    # Optional, looked up with getattr: ``blocks_freed(block_ids)``, told the blocks that became
    # free (``BlockManager.on_free``), by an executor that keeps per-sequence state outside the pool.


class ProfilingUnsupported(RuntimeError):
    """The executor has nothing to profile (the synthetic engine runs no model)."""
