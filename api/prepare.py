"""The one preparation path of every API: a typed request body to a checked request, then to
its ``Generation``.

Every generating endpoint (chat and text completions, Anthropic messages, and
through them the Responses API and message batches) runs these steps, each of
which can refuse the request with the API's 4xx before any engine work:

1. the model name, then the request's disaggregated leg
   (``api.disaggregation.start_leg``: a gen leg is verified before its
   prompt is read);
2. the API's own checks (``ApiRequest.check``: ``n``, tool choice, ...) and
   its stop strings;
3. the prompt's token ids: a gen leg's signed ids (never re-tokenized), else
   the API's prompt rendered and tokenized;
4. the sampling params, with the leg's engine params (a ctx leg samples one
   token);
5. on a worker, the ``Generation``, with the leg as its output hook.

The orchestrator runs steps 1-4 (``check_request``) on a ``ServingContext``
without an engine (``orchestrator.validation``), so it refuses what a worker
would refuse and routes with the same prompt ids. An API plugs in as an
``ApiRequest`` (``openai_api.CompletionApi`` / ``ChatApi``,
``anthropic_api.MessagesApi``): what differs between APIs is there, the
order and the disaggregation are here.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Protocol

from api.disaggregation import DisaggLeg, add_ctx_fields, add_ctx_fields_json, engine_params, start_leg
from api.generation import Generation
from api.serving import ServingContext
from workers.disagg_params import DisaggParams
from workers.sampling_params import SamplingParams

__all__ = ["ApiBody", "ApiRequest", "ValidRequest", "PreparedRequest", "check_request", "prepare_request"]


class ApiBody(Protocol):
    """The fields every API's request body has (``msgspec`` structs)."""

    @property
    def model(self) -> str: ...
    @property
    def stream(self) -> bool: ...
    @property
    def disaggregated_params(self) -> DisaggParams | None: ...


class ApiRequest(Protocol):
    """One API's part of preparing its body (raises the API's errors, naming its parameters)."""

    @property
    def body(self) -> ApiBody: ...

    def check(self, ctx: ServingContext, leg: DisaggLeg | None) -> None:
        """What the body alone can get wrong, once the leg is known."""

    def stop_strings(self) -> tuple[str, ...]: ...

    def prompt_ids(self, ctx: ServingContext) -> list[int]:
        """The prompt rendered and tokenized (a plain request or a ctx leg), checked against the limits."""

    def sampling_params(self, ctx: ServingContext, num_prompt_tokens: int) -> SamplingParams: ...


class ValidRequest(NamedTuple):
    """A request body checked whole: what starting its generation needs."""

    prompt_ids: list[int]
    params: SamplingParams  # the engine's: a leg's engine params applied
    stop_strings: tuple[str, ...]
    leg: DisaggLeg | None


def check_request(ctx: ServingContext, request: ApiRequest) -> ValidRequest:
    """Steps 1-4 (module doc): no engine work; the orchestrator runs this too."""
    body = request.body
    ctx.check_model(body.model)
    leg = start_leg(ctx.config.disagg, body.disaggregated_params, body.stream)
    request.check(ctx, leg)
    stops = request.stop_strings()
    if leg is not None and not leg.is_context:
        prompt_ids = leg.signed_prompt_ids()
        # The first token (a resumed leg's output) rides with the prompt to the engine: checked with it.
        ctx.check_prompt_token_ids(prompt_ids + leg.carried_ids(), "disaggregated_params.prompt_token_ids")
    elif leg is not None and leg.given_prompt_ids is not None:
        # A ctx leg with the orchestrator's ids: it rendered and tokenized the body already, so the
        # template is not run again; the ids are checked as any token-id prompt is.
        prompt_ids = leg.given_prompt_ids
        ctx.check_prompt_token_ids(prompt_ids, "disaggregated_params.prompt_token_ids")
    else:
        prompt_ids = request.prompt_ids(ctx)
    params = request.sampling_params(ctx, len(prompt_ids))
    if leg is not None:
        params = engine_params(leg, params)
    return ValidRequest(prompt_ids, params, stops, leg)


class PreparedRequest:
    """A checked request and its generation, not started yet (iterating it starts it)."""

    __slots__ = ("generation", "leg")

    def __init__(self, generation: Generation, leg: DisaggLeg | None) -> None:
        self.generation = generation
        self.leg = leg

    def response_ids(self, ctx: ServingContext, prefix: str) -> tuple[str, int]:
        """The answer's id and creation time: a resumed stream's own (its client holds them), else new."""
        params = None if self.leg is None or not self.leg.is_resume else self.leg.params
        if params is not None and params.response_id is not None and params.created is not None:
            return params.response_id, params.created
        return f"{prefix}-{ctx.response_ids.next_hex()}", int(time.time())

    def answer(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The non-streaming answer: a ctx leg's carries its ``disaggregated_params`` and prompt ids."""
        return add_ctx_fields(payload, self.leg, self.generation.prompt_token_ids)

    def answer_json(self, payload: bytes) -> bytes:
        """``answer`` on an already encoded body."""
        return add_ctx_fields_json(payload, self.leg, self.generation.prompt_token_ids)


def prepare_request(ctx: ServingContext, request: ApiRequest, arrival_time: float | None = None,
                    x_request_id: str | None = None) -> PreparedRequest:
    """Steps 1-5 (module doc): the engine checked alive, then its queue's room, after every check of the body.
    ``x_request_id``: the HTTP request's header (or a batch request's id), for its perf record."""
    valid = check_request(ctx, request)
    ctx.check_engine()
    ctx.check_queue(len(valid.prompt_ids))
    generation = Generation(ctx.client, ctx.tokenizer, valid.prompt_ids, valid.params, valid.stop_strings,
                            arrival_time, valid.leg, x_request_id)
    if valid.leg is not None:
        generation.prompt_logprobs = valid.leg.carried_prompt_logprobs()
    return PreparedRequest(generation, valid.leg)
