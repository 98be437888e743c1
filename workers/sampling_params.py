"""Sampling parameters: what a request asks of the sampler.

Torch-free: frontends build these from API bodies and send them on the wire.
"""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, array_like=True, gc=False):
    """How to pick each next token.

    ``temperature == 0`` means greedy. ``top_k`` and ``top_p`` are off when None.
    ``seed`` makes sampling a pure function of (seed, output position): the same
    request gives the same tokens whatever else shares its batch.
    ``max_tokens`` counts generated tokens; the engine also stops at the model
    length (finish reason ``length``), whichever comes first.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token; None: none

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the field when a value is out of range."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
