"""Next-token sampling for a batch of requests with per-request parameters.

Order per row: min_tokens masking -> penalties -> logit bias -> grammar
mask -> (greedy argmax) or (temperature -> top-k -> top-p -> min-p -> draw).
Greedy rows are one vectorised argmax; random rows share the vectorised
filtering and differ only in their noise. Penalties, bias and grammar masks
(``workers.engine.logits_processors``) touch only the rows that ask for them;
a batch where no row does takes exactly the path it took before they existed.
A constrained row skips min_tokens masking: its grammar alone decides when it
may end (the engine finishes it the moment the grammar is complete).

Seeded requests draw with the exponential-race trick (argmax of
probs / Exp(1) noise, equivalent to sampling from probs) using noise from a
generator seeded by (seed, output position) alone, so the token is a pure
function of the request's own logits, seed and position: the same whatever
else shares the batch, and reproducible after preemption or on another
worker. Logprobs are those of the model's raw distribution (before
penalties, bias, grammar, temperature and filtering), as vLLM and the OpenAI
API report them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workers.engine.executor import ExecutorOutput, SampledToken, SchedulerOutput
from workers.engine.logits_processors import (
    apply_grammar_masks,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    has_penalties,
)
from workers.engine.prompt_logprobs import prompt_logprobs
from workers.engine.speculative import accepted
from workers.protocol import TokenLogprobs
from workers.sampling_params import SamplingParams

__all__ = ["SamplingRow", "Sampler", "sample_step"]

_MASK64 = 2**64 - 1


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs of one request: its params and output position; for
    penalties its tokens so far (live lists, read-only), for guided decoding its
    llguidance matcher (advanced by the scheduler, never here)."""

    params: SamplingParams
    num_output_tokens: int
    output_token_ids: Sequence[int] = ()
    prompt_token_ids: Sequence[int] = ()
    grammar: Any = None  # llguidance.LLMatcher


def position_seed(seed: int, num_output_tokens: int) -> int:
    """A 63-bit generator seed from (seed, output position): splitmix64 of their mix."""
    z = (seed * 0x9E3779B97F4A7C15 + num_output_tokens + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    def __init__(self, eos_token_ids: frozenset[int], device: torch.device, seed: int | None = None) -> None:
        self.eos_token_ids = eos_token_ids
        self.device = device
        # Unseeded requests draw from this one stream (seeded from the OS when
        # ``seed`` is None): random, but one generator per runner, not global state.
        self._generator = torch.Generator(device=device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        """One token per row of ``logits`` (S, V), float32."""
        raw = self._mask_min_tokens(logits, rows)
        logits = _processed(raw, rows)
        randoms = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if not randoms:  # all greedy, the common case: one argmax, no index copies of the logits
            return self._with_logprobs(raw, logits.argmax(dim=-1), rows)
        token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
        if greedy:
            index = torch.tensor(greedy, device=logits.device)
            token_ids[index] = logits[index].argmax(dim=-1)
        if randoms:
            index = torch.tensor(randoms, device=logits.device)
            token_ids[index] = self._sample_random(logits[index], [rows[i] for i in randoms])
        return self._with_logprobs(raw, token_ids, rows)

    def _mask_min_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        # Until min_tokens are out, the tokens that would end the request cannot be drawn.
        masked = None
        for i, row in enumerate(rows):
            if row.num_output_tokens >= row.params.min_tokens or row.grammar is not None:
                continue
            stop_ids = set(row.params.stop_token_ids)
            if not row.params.ignore_eos:
                stop_ids |= self.eos_token_ids
            stop_ids = {token_id for token_id in stop_ids if 0 <= token_id < logits.shape[1]}
            if stop_ids:
                masked = logits.clone() if masked is None else masked
                masked[i, sorted(stop_ids)] = float("-inf")
        return logits if masked is None else masked

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        temperatures = torch.tensor([row.params.temperature for row in rows], device=logits.device)
        logits = logits / temperatures.unsqueeze(1)
        if any(row.params.top_k is not None or row.params.top_p is not None for row in rows):
            logits = _top_k_top_p(logits, rows)
        if any(row.params.min_p > 0.0 for row in rows):
            logits = apply_min_p(logits, torch.tensor([row.params.min_p for row in rows], device=logits.device))
        probs = torch.softmax(logits, dim=-1)  # (R, V)
        noise = torch.empty_like(probs)
        unseeded = [i for i, row in enumerate(rows) if row.params.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty((len(unseeded), probs.shape[1]), device=probs.device).exponential_(
                generator=self._generator
            )
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                generator = torch.Generator(device=probs.device)
                generator.manual_seed(position_seed(row.params.seed, row.num_output_tokens))
                noise[i].exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1)

    def _with_logprobs(
        self, logits: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]
    ) -> list[SampledToken]:
        token_list = token_ids.tolist()
        wanted = [row.params.logprobs for row in rows]
        if all(n is None for n in wanted):
            return [SampledToken(token_id) for token_id in token_list]
        logprobs = torch.log_softmax(logits, dim=-1)  # (S, V)
        max_n = max(n for n in wanted if n is not None)
        # (S, max_n) each; with max_n 0 no row asks for alternatives and none reads them.
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        if max_n:
            top_value_tensor, top_id_tensor = logprobs.topk(max_n, dim=-1)
            top_values, top_ids = top_value_tensor.tolist(), top_id_tensor.tolist()
        chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
        sampled = []
        for i, (token_id, n) in enumerate(zip(token_list, wanted)):
            if n is None:
                sampled.append(SampledToken(token_id))
                continue
            entry = TokenLogprobs(
                token_id=token_id,
                logprob=chosen[i],
                top_token_ids=top_ids[i][:n] if n else [],
                top_logprobs=top_values[i][:n] if n else [],
            )
            sampled.append(SampledToken(token_id, entry))
        return sampled


def _processed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """``logits`` with penalties, bias and grammar masks applied (a copy), or ``logits``
    itself when no row asks for any."""
    penalized = [i for i, row in enumerate(rows) if has_penalties(row.params)]
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
    if not (penalized or biased or constrained):
        return logits
    logits = logits.clone()
    if penalized:
        apply_penalties(logits, rows, penalized)
    if biased:
        apply_logit_bias(logits, rows, biased)
    if constrained:
        apply_grammar_masks(logits, rows, constrained)
    return logits


def _top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and then top-p nucleus."""
    vocab_size = logits.shape[1]
    top_k = torch.tensor([row.params.top_k or vocab_size for row in rows], device=logits.device)
    top_p = torch.tensor([row.params.top_p or 1.0 for row in rows], device=logits.device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (R, V)
    ranks = torch.arange(vocab_size, device=logits.device).unsqueeze(0)  # (1, V)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep a token when the mass before it is below top_p: the first token always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p == 1 must keep everything, even where the cumsum rounds to >= 1.
    outside = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def sample_step(sampler: Sampler, batch: SchedulerOutput, logits: torch.Tensor) -> ExecutorOutput:
    """A step's output from its ``logits`` (one row per entry of ``batch`` with ``sample`` set, in order,
    an entry with k drafts k + 1 rows; then the rows of prompt logprobs: ``executor.logit_rows``)."""
    if batch.num_draft_tokens:
        return _verify_step(sampler, batch, logits)
    rows = [
        SamplingRow(r.sampling_params, r.num_output_tokens, r.output_token_ids, r.prompt_token_ids, r.grammar)
        for r in batch.requests
        if r.sample
    ]
    with torch.inference_mode():
        if logits.shape[0] == len(rows):  # the common step: no prompt logprobs asked
            return ExecutorOutput.of(batch, sampler.sample(logits, rows) if rows else [])
        tokens = sampler.sample(logits[: len(rows)], rows) if rows else []
        return ExecutorOutput.of(batch, tokens, prompt_logprobs(batch.requests, logits[len(rows) :]))


def _verify_step(sampler: Sampler, batch: SchedulerOutput, logits: torch.Tensor) -> ExecutorOutput:
    """``sample_step`` of a batch with drafts: a row per position after the last token and each draft
    (output position j further on: ``min_tokens`` masks by it), all sampled at once; each entry then
    keeps the drafts its samples confirm and one sample more (``speculative.accepted``). Rows past
    those are prompt logprobs' (another entry's prefill chunk in the same step)."""
    rows: list[SamplingRow] = []
    for r in batch.requests:
        if r.sample:
            for j in range(len(r.draft_token_ids) + 1):
                rows.append(SamplingRow(r.sampling_params, r.num_output_tokens + j, r.output_token_ids,
                                        r.prompt_token_ids, r.grammar))
    with torch.inference_mode():
        sampled = sampler.sample(logits[: len(rows)], rows)
        scored = prompt_logprobs(batch.requests, logits[len(rows) :]) if logits.shape[0] > len(rows) else None
    firsts: list[SampledToken] = []
    more: list[list[int]] = []
    at = 0
    for r in batch.requests:
        if not r.sample:
            more.append([])
            continue
        width = len(r.draft_token_ids) + 1
        tokens = accepted(r.draft_token_ids, [s.token_id for s in sampled[at:at + width]])
        firsts.append(sampled[at])
        more.append(tokens[1:])
        at += width
    output = ExecutorOutput.of(batch, firsts, scored)
    output.more_token_ids = more
    return output
