"""Sampling parameters: what a request asks of the sampler.

Torch-free: frontends build these from API bodies and send them on the wire.
"""

from __future__ import annotations

import msgspec

GUIDED_KINDS = ("json_schema", "lark", "regex")
MAX_STREAM_INTERVAL = 1024
"""The most tokens one streamed output may gather (``SamplingParams.stream_interval``)."""


class ParamError(ValueError):
    """A sampling parameter is out of range; ``param`` names it for the API's error body.

    A ``ValueError`` so the engine's own admission check still catches it, but a
    distinct type so the frontends answer only this with a 400: any other
    ``ValueError`` is a bug and must surface as a logged 500.
    """

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class GuidedDecoding(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A grammar that the sampler enforces token by token (llguidance).

    ``kind`` is one of ``GUIDED_KINDS``: ``json_schema`` (``spec`` is the schema as
    JSON text; ``{"type": "object"}`` for any JSON object), ``lark`` (an llguidance
    Lark grammar, which may embed JSON schemas with ``%json{...}``: how tool calls
    are forced into the model's own call format) or ``regex``.
    """

    kind: str
    spec: str


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
    # The logprob of each prompt token given its prefix and the top-n alternatives (vLLM's
    # ``prompt_logprobs``); None: none. The engine computes them only for requests that ask.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # CTRL/HF: divides positive (multiplies negative) logits of prompt and output tokens
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the top token's
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), bias in [-100, 100]
    guided: GuidedDecoding | None = None  # structured output / forced tool calls
    stream_interval: int | None = None  # tokens per output after the first; None: the engine's stream_interval
    # Not a sampling knob: it rides with them to the scheduler, whose waiting queue serves lower values
    # first (vLLM's ``priority``), equal ones in arrival order.
    priority: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ParamError naming the field when a value is out of range."""
        if self.max_tokens < 1:
            raise ParamError(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise ParamError(f"temperature must be in [0, 100], got {self.temperature}", "temperature")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ParamError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k is not None and self.top_k < 1:
            raise ParamError(f"top_k must be >= 1, got {self.top_k}", "top_k")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ParamError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}", "min_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ParamError(f"logprobs must be in [0, 20], got {self.logprobs}", "logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ParamError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}", "prompt_logprobs")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ParamError(f"seed must be in [0, 2**63), got {self.seed}", "seed")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ParamError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ParamError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}", "frequency_penalty")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ParamError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
                             "repetition_penalty")
        if not 0.0 <= self.min_p <= 1.0:
            raise ParamError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not -100.0 <= bias <= 100.0:
                raise ParamError(f"logit_bias must map token ids >= 0 to values in [-100, 100], got {token_id}: {bias}",
                                 "logit_bias")
        if self.stream_interval is not None and not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ParamError(f"stream_interval must be in [1, {MAX_STREAM_INTERVAL}], got {self.stream_interval}",
                             "stream_interval")
        if self.guided is not None and self.guided.kind not in GUIDED_KINDS:
            raise ParamError(f"guided.kind must be one of {GUIDED_KINDS}, got {self.guided.kind!r}", "guided.kind")
