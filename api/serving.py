"""What every API handler shares: the engine client, the tokenizer, the served
model, and the checks that turn an API body into a valid engine request.

Length policy (documented once, here): a request needs
``prompt tokens + max_tokens <= max_model_len``. ``max_tokens`` is never
clamped: a request that asks for more than fits is a 400 that names the
limit and the largest ``max_tokens`` that would fit, because silently
shortening the answer changes its meaning (vLLM does the same). When the
API lets ``max_tokens`` be omitted (OpenAI chat), it defaults to all the
room left: ``max_model_len - prompt tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from api.body_limit import DEFAULT_MAX_REQUEST_BYTES
from api.disaggregation import DisaggConfig
from api.errors import InvalidRequestError, ModelNotFoundError, PromptTooLongError
from api.generation import EngineClientLike
from api.response_ids import ResponseIds
from api.structured import GrammarChecker
from api.tokenizer import Tokenizer
from api.tool_parsers import CallSyntax, detect_tool_syntax, tool_syntax
from workers.sampling_params import GuidedDecoding, ParamError, SamplingParams

if TYPE_CHECKING:
    from api.tool_calls import ToolPolicy

__all__ = ["FrontendConfig", "ServingContext"]


@dataclass(frozen=True)
class FrontendConfig:
    served_model_name: str
    """The model name clients send and /v1/models lists (default: the model dir's basename)."""
    frontend_id: int = 0
    """This process's index in its worker; sent as the ``x-disagg-frontend`` header."""
    version: str = "0.1.0"
    disagg: DisaggConfig | None = None
    """Disaggregated serving: role, cluster key, KV endpoint (None: plain requests only)."""
    tool_call_parser: str | None = None
    """The model's tool-call format (``api.tool_parsers.TOOL_CALL_PARSERS``); None: detected from
    the chat template (no format found: tool calls are not parsed and cannot be forced)."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Request bodies over this are refused with 413 before they are buffered."""
    max_concurrent_requests: int | None = None
    """This frontend's share of its worker's concurrent generation requests (``api.admission``);
    more get 429 with Retry-After. None: no limit."""
    max_queued_requests: int | None = None
    max_queued_prompt_tokens: int | None = None
    """This frontend's shares of its worker's bounds on requests sent to the engine without a first
    token yet, and on their prompt tokens (``api.admission.QueueBound``). None: no bound."""
    max_perf_records: int | None = None
    perf_record_seconds: float | None = None
    """The launcher's perf-record store bounds (``frontends.perf_records.PerfStore``; None: its defaults)."""
    otlp_endpoint: str | None = None
    """Export each request's spans over OTLP/HTTP to this collector (``api.tracing``); None: off."""
    trace_service_name: str = "disagg-worker"
    role: str = "both"
    """The worker's role (ctx, gen, both), on its spans."""
    strict_request_fields: bool = False
    """An unknown top-level request field is a 400 naming it; False: ignored, named in a ``Warning``
    header (``api.request_fields``)."""
    worker_key: str | None = field(default=None, repr=False)
    """The deployment's worker key (``--worker-key-file``): required on every route but /health
    over TCP (``api.api_key``); None: none is required."""

    @classmethod
    def for_model_dir(cls, model_dir: str | Path, frontend_id: int = 0,
                      served_model_name: str | None = None) -> FrontendConfig:
        name = served_model_name or Path(model_dir).resolve().name
        return cls(served_model_name=name, frontend_id=frontend_id)


class ServingContext:
    """The state one frontend process serves from (one per app)."""

    def __init__(self, client: EngineClientLike, tokenizer: Tokenizer, config: FrontendConfig) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = config.served_model_name
        self.tool_syntax: CallSyntax | None = (
            tool_syntax(config.tool_call_parser) if config.tool_call_parser
            else detect_tool_syntax(tokenizer.chat_template_source))
        self._grammar_checker: GrammarChecker | None = None  # built on the first constrained request
        self.response_ids = ResponseIds()
        self.frontends_down_file: Path | None = None
        """A worker's ``workers.frontends_down`` file (set by ``frontends.worker_app``): /health reads it."""

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ModelNotFoundError(
                f"the model {model!r} does not exist; this server serves {self.model_name!r}", param="model"
            )

    def forced_tool_guided(self, policy: ToolPolicy) -> GuidedDecoding | None:
        """The grammar of a forced tool call (None when the choice is not forced)."""
        return policy.guided(self.tool_syntax)

    def answer_grammar(self, policy: ToolPolicy, guided: GuidedDecoding | None,
                       guided_param: str) -> tuple[GuidedDecoding | None, str]:
        """The grammar the answer follows and the parameter that asked for it: a forced tool call's
        (the answer is the call: the body's output format does not apply to it), else the body's."""
        tool_guided = self.forced_tool_guided(policy)
        return (guided, guided_param) if tool_guided is None else (tool_guided, "tool_choice")

    def check_engine(self) -> None:
        if not self.client.is_healthy:
            raise self.client.unavailable_error()

    def check_queue(self, num_prompt_tokens: int) -> None:
        """Refuse (``OverloadedError``: 429/529) a request the worker's queue bound has no room for,
        before any of its answer is sent (``api.admission.QueueBound``)."""
        self.client.queue.check(num_prompt_tokens)

    def check_prompt_token_ids(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param=param)
        vocab_size = self.client.vocab_size
        for token_id in token_ids:
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(f"token id {token_id} is outside the vocabulary [0, {vocab_size})",
                                          param=param)

    def sampling_params(
        self,
        num_prompt_tokens: int,
        max_tokens: int | None,
        *,
        max_tokens_param: str = "max_tokens",
        prompt_param: str = "prompt",
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        min_tokens: int = 0,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        min_p: float | None = None,
        logit_bias: tuple[tuple[int, float], ...] = (),
        guided: GuidedDecoding | None = None,
        guided_param: str = "response_format",
        stream_interval: int | None = None,
        priority: int = 0,
    ) -> SamplingParams:
        """Validated SamplingParams, or InvalidRequestError / PromptTooLongError.

        ``guided`` must compile for this model's tokenizer, else a 400 naming ``guided_param``."""
        limit = self.client.max_model_len
        if num_prompt_tokens >= limit:
            raise PromptTooLongError(
                f"this model's maximum context length is {limit} tokens, for the prompt and at least one "
                f"generated token; the prompt has {num_prompt_tokens} tokens",
                param=prompt_param,
            )
        if max_tokens is None:
            max_tokens = limit - num_prompt_tokens
        elif num_prompt_tokens + max_tokens > limit:
            raise PromptTooLongError(
                f"this model's maximum context length is {limit} tokens; the request needs "
                f"{num_prompt_tokens} prompt tokens + {max_tokens} {max_tokens_param} = "
                f"{num_prompt_tokens + max_tokens}; lower {max_tokens_param} to at most {limit - num_prompt_tokens}",
                param=max_tokens_param,
            )
        if top_k is not None and top_k in (0, -1):
            top_k = None  # OpenAI-compatible servers (vLLM) use 0 / -1 for "off"
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if temperature is None else temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            min_tokens=min_tokens,
            stop_token_ids=tuple(stop_token_ids or ()),
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=presence_penalty or 0.0,
            frequency_penalty=frequency_penalty or 0.0,
            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
            min_p=min_p or 0.0,
            logit_bias=logit_bias,
            guided=guided,
            stream_interval=stream_interval,
            priority=priority,
        )
        try:
            params.validate()
        except ParamError as exc:
            raise InvalidRequestError(str(exc), param=exc.param) from exc
        for token_id in params.stop_token_ids:
            if not 0 <= token_id < self.client.vocab_size:
                raise InvalidRequestError(f"stop token id {token_id} is outside the vocabulary", param="stop_token_ids")
        if guided is not None:
            self.check_guided(guided, guided_param)
        return params

    def check_guided(self, guided: GuidedDecoding, param: str) -> None:
        """A 400 naming ``param`` and what is unsupported when ``guided`` does not compile."""
        if self._grammar_checker is None:
            self._grammar_checker = GrammarChecker(self.tokenizer, self.client.vocab_size)
        self._grammar_checker.check(guided, param)
