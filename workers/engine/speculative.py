"""Prompt-lookup (n-gram) speculative decoding: the drafts, and which of them the model accepts.

At a decode step of an eligible request the scheduler asks ``Speculator.drafts`` for up to k
tokens: the last n tokens of the request's prompt + output are looked up earlier in them (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``, the most recent match), and the tokens that
followed that match are the drafts. The step then computes the request's last token and the k
drafts in one forward (a short chunk over its paged KV) and samples a token after each of the
k + 1 positions; ``accepted`` keeps the longest prefix of drafts equal to those samples, plus the
sample after it (the bonus token). So a step yields 1 to k + 1 tokens, each the token a step
without drafts would have sampled at that position: greedy output is token for token the same.

Which requests speculate: greedy ones (temperature 0) without a grammar, logprobs or penalties.
Under greedy sampling acceptance is exact by construction; sampled requests are not speculated
(exact acceptance needs the rejection rule of speculative sampling and the sampler's draws per
position, not built yet), nor are constrained ones (each verified position needs the grammar's
mask after the drafts before it), nor ones asking for logprobs or penalties (position-dependent
state the sampler reads from the live output list). Positions past the accepted tokens hold the
rejected drafts' KV: ``num_computed_tokens`` never counts them, so the next step overwrites
them, and blocks allocated only for them are released at once. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.config import SpeculativeConfig
from workers.engine.request import Request

__all__ = ["Speculator", "propose_ngram", "accepted"]


def propose_ngram(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix of
    ``tokens`` of ``max_n`` down to ``min_n`` tokens; [] when no such suffix occurs earlier."""
    num_tokens = len(tokens)
    if k < 1 or num_tokens < min_n + 1:
        return []
    # Backwards through a reversed copy: list.index runs in C, the candidates are the positions of
    # the last token, most recent first (a Python scan of a long prompt costs ~1 ms a step).
    reverse = list(reversed(tokens))
    last = reverse[0]
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = reverse[:n]
        at = 1
        while True:
            try:
                at = reverse.index(last, at)
            except ValueError:
                break
            if at + n > num_tokens:
                break  # the n tokens ending here would start before the first token
            if reverse[at:at + n] == suffix:
                end = num_tokens - at  # the match is tokens[end - n:end]; the drafts follow it
                return list(tokens[end:end + k])
            at += 1
    return []


def accepted(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a verify step yields: ``sampled[j]`` is the token sampled after the request's
    last token and ``drafts[:j]``; the drafts equal to the samples, then one sample more."""
    n = 0
    while n < len(drafts) and drafts[n] == sampled[n]:
        n += 1
    return list(sampled[:n + 1])


class Speculator:
    """The scheduler's draft source (one per engine with speculation on)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def drafts(self, request: Request, budget: int) -> list[int]:
        """The drafts for the request's next step, [] when it should decode plainly. Never more than
        its output may still grow by less one (the step's bonus token): ``max_tokens`` and the model
        length are never overrun, and ``budget`` (the step's tokens left) holds them and the last token."""
        if not _eligible(request):
            return []
        k = min(self.num_tokens, request.length_limit - len(request.output_token_ids) - 1, budget - 1)
        if k < 1:
            return []
        return propose_ngram(request.prompt_token_ids + request.output_token_ids, self.min_n, self.max_n, k)


def _eligible(request: Request) -> bool:
    params = request.sampling_params
    return (params.is_greedy and request.grammar is None and params.logprobs is None
            and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
            and params.repetition_penalty == 1.0)
