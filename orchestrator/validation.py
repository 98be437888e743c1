"""Validate once, before any work: a client body checked whole by the workers' own code.

The orchestrator runs the frontends' ``check_request`` (``api.prepare``: schema, model
name, stop strings, message and tool bounds, sampling ranges, guided-decoding
grammars, and prompt tokens + ``max_tokens`` against the context length) on
a ``ServingContext`` that has no engine behind it, only the limits the
workers reported. A request that a worker would refuse is refused here, in
the API's shape, before a ctx worker is chosen: no prefill is spent on it and
no leg is sent. The prompt's token ids come out of the same call, so the
prompt is rendered and tokenized once.

``max_model_len`` and ``vocab_size`` are the smallest any known worker
reported in /worker_info (a prompt must fit wherever it is routed); until
one has been heard from, the length check is left to the workers and token
ids are checked against the tokenizer's vocabulary.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncGenerator, Callable
from typing import Protocol

from api.admission import QueueBound
from api.serving import FrontendConfig, ServingContext
from api.tokenizer import Tokenizer
from api.tool_calls import ToolPolicy
from workers.protocol import EngineRequest, IngressMessage, RequestOutput
from workers.sampling_params import GuidedDecoding, SamplingParams

__all__ = ["RequestValidator", "WorkerLimitsSource"]

class WorkerLimitsSource(Protocol):
    """The workers' limits as the orchestrator knows them now (None: no worker reported one yet)."""

    def max_model_len(self) -> int | None: ...

    def vocab_size(self) -> int | None: ...


# No worker heard from yet: no length limit here (the workers still check theirs).
_NO_LIMIT_YET = sys.maxsize // 2


class _WorkerLimits:
    """What a ``ServingContext`` reads of its engine client, from what the workers reported."""

    def __init__(self, limits: WorkerLimitsSource, tokenizer_vocab_size: int) -> None:
        self.eos_token_ids: tuple[int, ...] = ()
        self._limits = limits
        self._tokenizer_vocab_size = tokenizer_vocab_size

    @property
    def vocab_size(self) -> int:
        known = self._limits.vocab_size()
        return self._tokenizer_vocab_size if known is None else known

    @property
    def max_model_len(self) -> int:
        known = self._limits.max_model_len()
        return _NO_LIMIT_YET if known is None else known

    @property
    def is_healthy(self) -> bool:
        return True

    @property
    def queue(self) -> QueueBound:  # pragma: no cover - check_request checks no queue
        raise AssertionError("validation has no engine")

    def unavailable_error(self) -> Exception:  # pragma: no cover - never unhealthy
        raise AssertionError("validation has no engine")

    # The rest of EngineClientLike: never called (check_request starts no generation; prepare_request would,
    # and only workers call it).
    def generate(self, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float | None = None,
                 make_message: Callable[[EngineRequest], IngressMessage] | None = None,
                 x_request_id: str | None = None) -> AsyncGenerator[RequestOutput, None]:  # pragma: no cover
        raise AssertionError("validation has no engine")

    async def abort(self, request_id: int) -> None:  # pragma: no cover
        raise AssertionError("validation has no engine")


class RequestValidator(ServingContext):
    """A ``ServingContext`` without an engine: checks bodies, never starts a generation."""

    def __init__(self, tokenizer: Tokenizer, model_name: str, limits: WorkerLimitsSource,
                 strict_request_fields: bool = False) -> None:
        vocab_size = tokenizer.backend.get_vocab_size(with_added_tokens=True)
        super().__init__(_WorkerLimits(limits, vocab_size), tokenizer,
                         FrontendConfig(served_model_name=model_name, strict_request_fields=strict_request_fields))

    def forced_tool_guided(self, policy: ToolPolicy) -> GuidedDecoding | None:
        # The workers may name their tool-call format (--tool-call-parser) where the orchestrator,
        # which only detects it from the template, knows none: then the workers decide.
        return None if self.tool_syntax is None else super().forced_tool_guided(policy)
