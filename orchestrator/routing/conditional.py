"""Conditional disaggregation: when the ctx leg costs more than it saves.

The gen worker would prefill only the prompt tokens it does not already hold.
Skip the ctx leg (send the gen worker a normal request) when those are few
(``max_local_prefill_tokens``) or when it holds most of the prompt's full
blocks (``min_cached_fraction``).
"""

from __future__ import annotations

from orchestrator.config import ConditionalDisaggConfig

__all__ = ["should_skip_ctx"]


def should_skip_ctx(config: ConditionalDisaggConfig, num_prompt_tokens: int, matched_blocks: int,
                    block_size: int) -> bool:
    if not config.enabled:
        return False
    num_cached_tokens = min(matched_blocks * block_size, num_prompt_tokens)
    if num_prompt_tokens - num_cached_tokens <= config.max_local_prefill_tokens:
        return True
    num_full_blocks = num_prompt_tokens // block_size
    return num_full_blocks > 0 and matched_blocks / num_full_blocks >= config.min_cached_fraction
