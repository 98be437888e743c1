"""Synthetic prompt text from the word list shipped with the package (no downloads).

Token counts are hit by scaling words with a tokens-per-word ratio measured once through the
deployment's ``POST /tokenize`` (vLLM's shape) when it has one, else estimated.
"""

from __future__ import annotations

import random
from functools import lru_cache
from importlib import resources

import httpx

__all__ = ["TextSource", "ESTIMATED_TOKENS_PER_WORD", "measure_tokens_per_word"]

# BPE tokenizers (Llama, SmolLM2, GPT) spend 1.1-1.4 tokens on a common English word with its space.
ESTIMATED_TOKENS_PER_WORD = 1.3
_CALIBRATION_WORDS = 400


@lru_cache(maxsize=1)
def _words() -> tuple[str, ...]:
    return tuple(resources.files("disagg.bench").joinpath("words.txt").read_text(encoding="utf-8").split())


class TextSource:
    """Random word text of about ``n`` tokens: ``make(n, rng)``."""

    def __init__(self, tokens_per_word: float = ESTIMATED_TOKENS_PER_WORD) -> None:
        self.tokens_per_word = tokens_per_word
        self.words = _words()

    def make(self, num_tokens: int, rng: random.Random) -> str:
        num_words = max(1, round(num_tokens / self.tokens_per_word))
        return " ".join(rng.choices(self.words, k=num_words))


async def measure_tokens_per_word(client: httpx.AsyncClient, base_url: str, model: str | None) -> float | None:
    """Tokens per word of the shipped text under the deployment's tokenizer, or None when it has no
    ``/tokenize`` (a peer's server): callers then use the estimate."""
    text = TextSource().make(round(_CALIBRATION_WORDS * ESTIMATED_TOKENS_PER_WORD), random.Random(0))
    body: dict[str, object] = {"prompt": text, "add_special_tokens": False}
    if model:
        body["model"] = model
    try:
        response = await client.post(f"{base_url}/tokenize", json=body)
        count = response.json().get("count") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return count / len(text.split()) if isinstance(count, int) and count > 0 else None
