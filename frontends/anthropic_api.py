"""Anthropic-compatible handlers: /v1/messages and /v1/messages/count_tokens.

The conversation goes through the model's chat template like an OpenAI chat
request (system first, tools as OpenAI-style function definitions, which is
what chat templates expect); generation and streaming share the one path in
``frontends.generation``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontends import disaggregation
from frontends.errors import ApiError, InvalidRequestError, anthropic_error_body
from frontends.generation import Completion, Generation, Piece, stream_events
from frontends.schemas_anthropic import (
    STOP_REASONS,
    CountTokensRequest,
    MessageEventEncoder,
    MessagesRequest,
    TextBlock,
)
from frontends.serving import ServingContext
from frontends.structured import anthropic_guided
from frontends.streaming import EventStreamResponse, run_until_disconnect
from frontends.tokenizer import ChatTemplateError

__all__ = ["create_message", "count_message_tokens", "prepare_message", "encode_message", "generate_message"]


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(block.text for block in content)


def _stop_reason(finish_reason: str | None, stop_string: str | None) -> str:
    if stop_string is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason or "stop", "end_turn")


def message_prompt_ids(ctx: ServingContext, body: MessagesRequest | CountTokensRequest) -> list[int]:
    if not body.messages:
        raise InvalidRequestError("messages must not be empty")
    messages: list[dict[str, Any]] = []
    if body.system is not None:
        messages.append({"role": "system", "content": _text(body.system)})
    messages.extend({"role": m.role, "content": _text(m.content)} for m in body.messages)
    tools = None
    if body.tools:
        tools = [
            {"type": "function",
             "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema}}
            for t in body.tools
        ]
    try:
        return ctx.tokenizer.encode_chat(messages, tools=tools, add_generation_prompt=True)
    except ChatTemplateError as exc:
        raise InvalidRequestError(str(exc)) from exc


class _MessageStream:
    def __init__(self, encoder: MessageEventEncoder) -> None:
        self.encoder = encoder

    def start(self, generation: Generation) -> list[bytes]:
        encoder = self.encoder
        # Cached tokens are known here for a gen leg only; message_delta carries the final count.
        return [encoder.message_start(generation.num_prompt_tokens, generation.num_usage_cached_tokens),
                encoder.content_block_start(), encoder.ping()]

    def piece(self, piece: Piece) -> bytes | None:
        return self.encoder.text_delta(piece.text) if piece.text else None

    def finish(self, generation: Generation, last: Piece) -> list[bytes]:
        encoder = self.encoder
        stop_reason = _stop_reason(last.finish_reason, last.stop_string)
        return [
            encoder.content_block_stop(),
            encoder.message_delta(stop_reason, last.stop_string, generation.num_prompt_tokens,
                                  generation.num_output_tokens, generation.num_usage_cached_tokens),
            encoder.message_stop(),
        ]

    def error(self, error: ApiError) -> list[bytes]:
        return [self.encoder.error(anthropic_error_body(error))]


def prepare_message(ctx: ServingContext, body: MessagesRequest,
                    arrival_time: float | None = None) -> tuple[Generation, MessageEventEncoder]:
    """A validated /v1/messages body as an engine generation and its encoder (raises the API's errors)."""
    ctx.check_model(body.model)
    leg = disaggregation.start_leg(ctx, body.disaggregated_params, body.stream)
    if leg is not None and not leg.is_context:
        prompt_ids = disaggregation.prompt_ids(ctx, leg)  # signed ids: never re-rendered
    else:
        prompt_ids = message_prompt_ids(ctx, body)
    params = ctx.sampling_params(
        len(prompt_ids), body.max_tokens, prompt_param="messages",
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        guided=anthropic_guided(body.output_config), guided_param="output_config.format",
    )
    generation = ctx.start_generation(prompt_ids, params, tuple(body.stop_sequences or ()), arrival_time, leg)
    return generation, MessageEventEncoder(f"msg_{uuid.uuid4().hex}", ctx.model_name)


def encode_message(generation: Generation, encoder: MessageEventEncoder, result: Completion) -> bytes:
    """The non-streaming response body (a ``message`` object) of a finished generation."""
    stop_reason = _stop_reason(result.finish_reason, result.stop_string)
    return encoder.message(result.text, stop_reason, result.stop_string, generation.num_prompt_tokens,
                           generation.num_output_tokens, generation.num_usage_cached_tokens)


async def generate_message(ctx: ServingContext, body: MessagesRequest) -> bytes:
    """Run one non-streaming /v1/messages body to its ``message`` JSON (the batch runner's path)."""
    generation, encoder = prepare_message(ctx, body, time.time())
    return encode_message(generation, encoder, await generation.collect())


async def create_message(ctx: ServingContext, request: Request) -> Response:
    arrival_time = time.time()
    body = msgspec.json.decode(await request.body(), type=MessagesRequest)
    generation, encoder = prepare_message(ctx, body, arrival_time)
    if body.stream:
        return EventStreamResponse(stream_events(generation, _MessageStream(encoder)))
    result = await run_until_disconnect(request.receive, generation.collect())
    payload = encode_message(generation, encoder, result)
    if generation.leg is not None:
        payload = disaggregation.add_ctx_fields_json(payload, generation.leg, generation.prompt_token_ids)
    return Response(payload, media_type="application/json")


async def count_message_tokens(ctx: ServingContext, request: Request) -> Response:
    body = msgspec.json.decode(await request.body(), type=CountTokensRequest)
    ctx.check_model(body.model)
    input_tokens = len(message_prompt_ids(ctx, body))
    return Response(msgspec.json.encode({"input_tokens": input_tokens}), media_type="application/json")
