"""Anthropic-compatible handlers: /v1/messages and /v1/messages/count_tokens.

The conversation goes through the model's chat template like an OpenAI chat
request (system first, tools as OpenAI-style function definitions, which is
what chat templates expect); generation and streaming share the one path in
``api.generation``.
"""

from __future__ import annotations

import time

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api.anthropic_tools import (
    ToolUseMessageStream,
    anthropic_tool_policy,
    check_thinking,
    message_content,
    prefill_text,
    template_messages,
)
from api.anthropic_tools import stop_reason as _stop_reason
from api.body_limit import read_body
from api.disaggregation import DisaggLeg
from api.errors import ApiError, InvalidRequestError, anthropic_error_body
from api.generation import Completion, Generation, Piece
from api.prepare import PreparedRequest, prepare_request
from api.push_stream import stream_response
from api.request_context import enter_request
from api.request_fields import decode_request
from api.request_limits import check_messages, check_tools, stop_strings
from api.schemas_anthropic import CountTokensRequest, MessageEventEncoder, MessagesRequest
from api.serving import ServingContext
from api.streaming import run_until_disconnect
from api.structured import anthropic_guided
from api.tokenizer import ChatTemplateError
from api.tool_calls import ToolPolicy
from api.tool_parsers import ToolCallParser
from api.tool_prompt import PromptSource, adapt_conversation
from workers.sampling_params import SamplingParams

__all__ = ["create_message", "count_message_tokens", "MessagesApi", "prepare_message", "encode_message",
           "generate_message", "message_prompt_ids"]


def message_prompt_ids(ctx: PromptSource, body: MessagesRequest | CountTokensRequest,
                       max_tokens: int | None = None) -> list[int]:
    """The prompt of a conversation; one that ends with an assistant's text continues that turn (prefill).
    Over ``max_tokens`` by its length alone: ``PromptTooLongError`` before tokenizing."""
    check_messages(len(body.messages))
    check_tools(len(body.tools or ()))
    messages = template_messages(body)
    prefill = prefill_text(body)
    if prefill is not None and not prefill.strip():
        messages.pop()  # an empty prefill: a new assistant turn, as without it
        prefill = None
    tools = None
    if body.tools:
        tools = [
            {"type": "function",
             "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema}}
            for t in body.tools
        ]
    messages = adapt_conversation(messages, tools, ctx.tokenizer.chat_template_source, ctx.tool_syntax)
    try:
        return ctx.tokenizer.encode_chat(messages, tools=tools, max_tokens=max_tokens,
                                         add_generation_prompt=prefill is None,
                                         continue_final_message=prefill is not None)
    except ChatTemplateError as exc:
        raise InvalidRequestError(str(exc), param="messages") from exc


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


class MessagesApi:
    """A /v1/messages body on the one preparation path (``api.prepare``)."""

    def __init__(self, body: MessagesRequest) -> None:
        self.body = body
        self.tool_policy = ToolPolicy()  # the body's, once check() has read it

    def check(self, ctx: ServingContext, leg: DisaggLeg | None) -> None:
        self.tool_policy = anthropic_tool_policy(self.body)
        # A ctx leg's max_tokens is the orchestrator's 1; the orchestrator checked the client's budget.
        check_thinking(self.body, self.tool_policy, check_budget=leg is None or not leg.is_context)

    def stop_strings(self) -> tuple[str, ...]:
        return stop_strings(self.body.stop_sequences, "stop_sequences")

    def prompt_ids(self, ctx: ServingContext) -> list[int]:
        return message_prompt_ids(ctx, self.body, ctx.client.max_model_len)

    def sampling_params(self, ctx: ServingContext, num_prompt_tokens: int) -> SamplingParams:
        body = self.body
        guided, guided_param = ctx.answer_grammar(self.tool_policy, anthropic_guided(body.output_config),
                                                  "output_config.format")
        return ctx.sampling_params(
            num_prompt_tokens, body.max_tokens, prompt_param="messages",
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, guided=guided,
            guided_param=guided_param, stream_interval=body.stream_interval, priority=body.priority,
        )


def prepare_message(ctx: ServingContext, body: MessagesRequest, arrival_time: float | None = None,
                    x_request_id: str | None = None
                    ) -> tuple[PreparedRequest, MessageEventEncoder, ToolCallParser | None]:
    """A /v1/messages body prepared (``api.prepare``), its encoder and its tool-call parser
    (None: the answer is text) (raises the API's errors); ``x_request_id`` goes on its perf record."""
    api = MessagesApi(body)
    prepared = prepare_request(ctx, api, arrival_time, x_request_id)
    encoder = MessageEventEncoder(f"msg_{ctx.response_ids.next_hex()}", ctx.model_name)
    return prepared, encoder, api.tool_policy.parser(ctx.tool_syntax, streaming=body.stream)


def encode_message(generation: Generation, encoder: MessageEventEncoder, result: Completion,
                   parser: ToolCallParser | None = None) -> bytes:
    """The non-streaming response body (a ``message`` object) of a finished generation."""
    cached = generation.num_usage_cached_tokens
    if parser is None:
        reason = _stop_reason(result.finish_reason, result.stop_string)
        return encoder.message(result.text, reason, result.stop_string, generation.num_prompt_tokens,
                               generation.num_output_tokens, cached)
    content = message_content(result.text, parser, result.finish_reason)
    reason = _stop_reason(result.finish_reason, result.stop_string, parser.num_calls)
    return encoder.message(result.text, reason, result.stop_string, generation.num_prompt_tokens,
                           generation.num_output_tokens, cached, content=content)


async def generate_message(ctx: ServingContext, body: MessagesRequest, request_id: str) -> bytes:
    """Run one non-streaming /v1/messages body to its ``message`` JSON (the batch runner's path;
    ``request_id``: its perf record's x-request-id)."""
    prepared, encoder, parser = prepare_message(ctx, body, time.time(), request_id)
    generation = prepared.generation
    return encode_message(generation, encoder, await generation.collect(), parser)


async def create_message(ctx: ServingContext, request: Request) -> Response:
    arrival_time = time.time()
    x_request_id = enter_request(request.scope)
    body = decode_request(await read_body(request.receive), MessagesRequest, ctx.config.strict_request_fields,
                          request.scope)
    prepared, encoder, parser = prepare_message(ctx, body, arrival_time, x_request_id)
    generation = prepared.generation
    if body.stream:
        stream = _MessageStream(encoder) if parser is None else ToolUseMessageStream(encoder, parser)
        return stream_response(generation, stream)
    result = await run_until_disconnect(request.receive, generation.collect())
    return Response(prepared.answer_json(encode_message(generation, encoder, result, parser)),
                    media_type="application/json")


async def count_message_tokens(ctx: ServingContext, request: Request) -> Response:
    body = msgspec.json.decode(await request.body(), type=CountTokensRequest)
    ctx.check_model(body.model)
    anthropic_tool_policy(body)
    input_tokens = len(message_prompt_ids(ctx, body))
    return Response(msgspec.json.encode({"input_tokens": input_tokens}), media_type="application/json")
