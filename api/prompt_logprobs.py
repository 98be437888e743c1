"""Prompt logprobs in the OpenAI-compatible answers.

The engine scores each prompt token given its prefix (``SamplingParams.prompt_logprobs``;
the first token has nothing to be scored by). Two ways to ask, two shapes:

- ``echo: true`` with ``logprobs: n`` on /v1/completions (OpenAI's legacy API):
  the prompt's tokens lead the choice's ``logprobs`` object, the first with
  ``null`` in ``token_logprobs`` and ``top_logprobs``; ``text_offset`` counts
  from the start of the choice's text, which starts with the prompt.
- ``prompt_logprobs: n`` (vLLM's extension) on /v1/completions (on each choice)
  and /v1/chat/completions (on the response, as vLLM puts it): a list with
  ``null`` first, then per token a map from token id to ``{logprob, rank,
  decoded_token}`` holding the prompt token and the top ``n``. Not with
  ``stream`` (vLLM refuses it too).

One engine request computes them for both, with the larger ``n``; the choices
of ``n`` > 1 share choice 0's (``api.choices``).
"""

from __future__ import annotations

from typing import Any

from api.detokenizer import IncrementalDetokenizer
from api.errors import InvalidRequestError
from api.tokenizer import Tokenizer
from workers.protocol import TokenLogprobs

__all__ = ["engine_top_n", "check_prompt_logprobs", "echo_logprobs", "vllm_prompt_logprobs", "joined_logprobs"]


def engine_top_n(*asked: int | None) -> int | None:
    """What the engine is asked for: the most alternatives any use wants, None when none asks."""
    wanted = [n for n in asked if n is not None]
    return max(wanted) if wanted else None


def check_prompt_logprobs(prompt_logprobs: int | None, stream: bool) -> None:
    if prompt_logprobs is not None and stream:
        raise InvalidRequestError("prompt_logprobs are not available with stream: true; ask without streaming, "
                                  "or use echo with logprobs on /v1/completions", param="prompt_logprobs")


def _entries(entries: list[TokenLogprobs] | None) -> list[TokenLogprobs]:
    if entries is None:  # the engine answers every request that asks (workers.engine.step_results)
        raise RuntimeError("the engine's first output carried no prompt logprobs for a request that asked")
    return entries


def echo_logprobs(tokenizer: Tokenizer, prompt_token_ids: list[int], entries: list[TokenLogprobs] | None,
                  top_n: int) -> dict[str, Any]:
    """The legacy ``logprobs`` object of the echoed prompt (offsets from 0, into its decoded text)."""
    tokens = [tokenizer.token_text(token_id) for token_id in prompt_token_ids]
    token_logprobs: list[float | None] = [None]
    top: list[dict[str, float] | None] = [None]
    for entry in _entries(entries):
        token_logprobs.append(entry.logprob)
        top.append({tokenizer.token_text(t): lp
                    for t, lp in zip(entry.top_token_ids[:top_n], entry.top_logprobs[:top_n])})
    # Offsets into the prompt's text as decoded (a token's own text may be part of a character).
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    offsets, offset = [], 0
    for token_id in prompt_token_ids:
        offsets.append(offset)
        offset += len(detokenizer.add([token_id]))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def joined_logprobs(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """Two legacy ``logprobs`` objects, ``first``'s tokens ahead of ``then``'s."""
    if then is None:
        return first
    return {key: first[key] + then[key] for key in first}


def vllm_prompt_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs] | None,
                         top_n: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: ``null``, then per prompt token its own entry and the top ``top_n``."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for entry in _entries(entries):
        position = {str(entry.token_id): {"logprob": entry.logprob, "rank": entry.rank,
                                          "decoded_token": tokenizer.token_text(entry.token_id)}}
        for rank, (token_id, logprob) in enumerate(zip(entry.top_token_ids[:top_n], entry.top_logprobs[:top_n]), 1):
            position.setdefault(str(token_id), {"logprob": logprob, "rank": rank,
                                                "decoded_token": tokenizer.token_text(token_id)})
        out.append(position)
    return out
