"""OpenAI-compatible handlers: /v1/completions, /v1/chat/completions, /v1/models.

Thin: decode the body, build the prompt and SamplingParams through the
ServingContext, then either stream (``push_stream.stream_response`` with an encoder from
this module) or collect the answer. Errors are raised, never rendered here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive

from api.body_limit import read_body
from api.choices import check_choices, choice_generations, collect_choices, stream_choices
from api.disaggregation import DisaggLeg
from api.errors import ApiError, InvalidRequestError, openai_error_body
from api.generation import Completion, Generation, Piece, StreamEncoder
from api.openai_tools import ToolCallChatStream, chat_message, finish_reason, openai_tool_policy, template_messages
from api.prepare import prepare_request
from api.prompt_logprobs import (
    check_prompt_logprobs,
    echo_logprobs,
    engine_top_n,
    joined_logprobs,
    vllm_prompt_logprobs,
)
from api.push_stream import stream_response
from api.request_context import enter_request
from api.request_fields import decode_request
from api.request_limits import check_chat_contents, check_messages, check_tools, stop_strings
from api.schemas_openai import (
    SSE_DONE,
    ChatChunkEncoder,
    ChatCompletionRequest,
    CompletionChunkEncoder,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
    chat_logprobs,
    completion_logprobs,
)
from api.serving import ServingContext
from api.streaming import EventStreamResponse, run_until_disconnect
from api.structured import openai_controls, openai_guided
from api.tokenizer import ChatTemplateError, Tokenizer, too_long_error
from api.tool_calls import ToolPolicy
from api.tool_prompt import PromptSource, adapt_conversation
from workers.sampling_params import SamplingParams

__all__ = ["create_completion", "create_chat_completion", "serve_chat_completion", "list_models",
           "CompletionApi", "ChatApi", "chat_prompt_ids", "check_prefill"]

_JSON = "application/json"


def _json_response(payload: Any) -> Response:
    return Response(msgspec.json.encode(payload), media_type=_JSON)


def _usage(generations: Sequence[Generation]) -> Usage:
    """The prompt once (the choices share it), every choice's completion tokens; the cached prompt
    tokens of choice 0 (the others hit its blocks)."""
    prompt, completion = generations[0].num_prompt_tokens, sum(g.num_output_tokens for g in generations)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(generations[0].num_usage_cached_tokens))


def _error_frames(error: ApiError) -> list[bytes]:
    return [b"data: " + openai_error_body(error) + b"\n\n", SSE_DONE]


async def _collect(receive: Receive, generations: list[Generation]) -> list[Completion]:
    if len(generations) == 1:  # the common case, without the choices' tasks
        return [await run_until_disconnect(receive, generations[0].collect())]
    return await run_until_disconnect(receive, collect_choices(generations))


class _CompletionStream:
    """One choice's stream; ``closes``: it is the whole stream (usage and ``[DONE]`` at its end),
    else one of ``n`` (``api.choices.stream_choices`` ends the stream). ``echo``: the text
    its first chunk holds; with ``echo_logprobs`` set (a ``(generation, top_n)`` whose prompt logprobs
    the chunk carries, choice 0's) that chunk waits for the first piece, as the prompt logprobs come
    with the engine's first output."""

    def __init__(self, encoder: CompletionChunkEncoder, tokenizer: Tokenizer, include_usage: bool,
                 closes: bool = True, echo: str = "", echo_logprobs: tuple[Generation, int] | None = None) -> None:
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.include_usage = include_usage
        self.closes = closes
        self.echo = echo
        self.echo_logprobs = echo_logprobs
        self.text_offset = len(echo)  # the choice's text starts with the echoed prompt

    def start(self, generation: Generation) -> list[bytes]:
        return [self.encoder.text(self.echo)] if self.echo and self.echo_logprobs is None else []

    def piece(self, piece: Piece) -> bytes | None:
        logprobs = None
        if piece.logprobs is not None:
            logprobs = completion_logprobs(self.tokenizer, piece.logprobs, self.text_offset)
        self.text_offset += len(piece.text)
        frame = self.encoder.text(piece.text, logprobs, piece.finish_reason)
        if self.echo_logprobs is None:
            return frame
        source, top_n = self.echo_logprobs
        self.echo_logprobs = None
        prompt = echo_logprobs(self.tokenizer, source.prompt_token_ids, source.prompt_logprobs, top_n)
        return self.encoder.text(self.echo, prompt) + frame

    def finish(self, generation: Generation, last: Piece) -> list[bytes]:
        if not self.closes:
            return []
        usage = [self.encoder.usage(_usage([generation]))] if self.include_usage else []
        return usage + [SSE_DONE]

    def error(self, error: ApiError) -> list[bytes]:
        return _error_frames(error)


class _ChatStream:
    """One choice's stream; ``closes`` as for ``_CompletionStream``."""

    def __init__(self, encoder: ChatChunkEncoder, tokenizer: Tokenizer, include_usage: bool,
                 closes: bool = True) -> None:
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.include_usage = include_usage
        self.closes = closes

    def start(self, generation: Generation) -> list[bytes]:
        return [self.encoder.role()]

    def piece(self, piece: Piece) -> bytes | None:
        if not piece.text and not piece.logprobs:
            return None
        logprobs = chat_logprobs(self.tokenizer, piece.logprobs) if piece.logprobs is not None else None
        return self.encoder.content(piece.text, logprobs)

    def finish(self, generation: Generation, last: Piece) -> list[bytes]:
        frames = [self.encoder.finish(last.finish_reason or "stop")]
        if not self.closes:
            return frames
        if self.include_usage:
            frames.append(self.encoder.usage(_usage([generation])))
        return frames + [SSE_DONE]

    def error(self, error: ApiError) -> list[bytes]:
        return _error_frames(error)


class CompletionApi:
    """A /v1/completions body on the one preparation path (``api.prepare``)."""

    def __init__(self, body: CompletionRequest) -> None:
        self.body = body
        self.num_choices = 1  # the body's n, once check() has read it (a ctx leg's is 1)

    def check(self, ctx: ServingContext, leg: DisaggLeg | None) -> None:
        body = self.body
        check_choices(body.n, body.best_of)
        self.num_choices = _num_choices(body.n, leg)
        check_prompt_logprobs(body.prompt_logprobs, body.stream)

    @property
    def echo_top_n(self) -> int | None:
        """The alternatives per echoed prompt token (``echo`` with ``logprobs``), None when not asked."""
        return self.body.logprobs if self.body.echo else None

    def echo_text(self, ctx: ServingContext, prompt_ids: list[int]) -> str:
        """What each choice's text starts with: the prompt when ``echo`` is asked, else nothing."""
        if not self.body.echo:
            return ""
        prompt = self.body.prompt
        return prompt if isinstance(prompt, str) else ctx.tokenizer.decode(prompt_ids, skip_special_tokens=False)

    def stop_strings(self) -> tuple[str, ...]:
        return stop_strings(self.body.stop, "stop")

    def prompt_ids(self, ctx: ServingContext) -> list[int]:
        prompt = self.body.prompt
        if not isinstance(prompt, str):
            ctx.check_prompt_token_ids(prompt, "prompt")
            return prompt
        # A huge string is refused on its length, before tokenizing it whole takes seconds and gigabytes.
        if ctx.tokenizer.proves_too_long(prompt, ctx.client.max_model_len):
            raise too_long_error(len(prompt), ctx.client.max_model_len, ctx.tokenizer.max_token_chars, "prompt")
        prompt_ids = ctx.tokenizer.encode(prompt)
        ctx.check_prompt_token_ids(prompt_ids, "prompt")
        return prompt_ids

    def sampling_params(self, ctx: ServingContext, num_prompt_tokens: int) -> SamplingParams:
        body = self.body
        guided, guided_param = openai_guided(body)
        return ctx.sampling_params(
            num_prompt_tokens, body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            seed=body.seed, min_tokens=body.min_tokens, stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos, logprobs=body.logprobs, guided=guided, guided_param=guided_param,
            prompt_logprobs=engine_top_n(self.echo_top_n, body.prompt_logprobs),
            **openai_controls(body, ctx.client.vocab_size),
        )


def _num_choices(n: int, leg: DisaggLeg | None) -> int:
    """A ctx leg prefills the prompt and samples choice 0's first token; the gen leg makes the n choices."""
    return 1 if leg is not None and leg.is_context else n


def _stream_usage(encoder: CompletionChunkEncoder | ChatChunkEncoder, generations: list[Generation],
                  include_usage: bool) -> list[bytes]:
    """The end of an ``n`` > 1 stream: the usage chunk when asked, ``[DONE]``."""
    return ([encoder.usage(_usage(generations))] if include_usage else []) + [SSE_DONE]


async def create_completion(ctx: ServingContext, request: Request) -> Response:
    arrival_time = time.time()
    x_request_id = enter_request(request.scope)
    body = decode_request(await read_body(request.receive), CompletionRequest, ctx.config.strict_request_fields,
                          request.scope)
    api = CompletionApi(body)
    prepared = prepare_request(ctx, api, arrival_time, x_request_id)
    generations = choice_generations(prepared.generation, api.num_choices)
    echo = api.echo_text(ctx, prepared.generation.prompt_token_ids)
    response_id, created = prepared.response_ids(ctx, "cmpl")
    first, echo_top_n = generations[0], api.echo_top_n
    echo_source = None if echo_top_n is None else (first, echo_top_n)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        if len(generations) == 1:
            encoder = _CompletionStream(CompletionChunkEncoder(response_id, created, ctx.model_name), ctx.tokenizer,
                                        include_usage, echo=echo, echo_logprobs=echo_source)
            return stream_response(first, encoder)
        chunks = [CompletionChunkEncoder(response_id, created, ctx.model_name, index)
                  for index in range(len(generations))]
        encoders: list[StreamEncoder] = [_CompletionStream(c, ctx.tokenizer, False, False, echo, echo_source)
                                         for c in chunks]
        return EventStreamResponse(stream_choices(
            generations, encoders, lambda: _stream_usage(chunks[0], generations, include_usage), _error_frames))
    choices = []
    for index, result in enumerate(await _collect(request.receive, generations)):
        logprobs = None
        if result.logprobs is not None:
            logprobs = completion_logprobs(ctx.tokenizer, result.logprobs, len(echo))
        if echo_top_n is not None:
            prompt = echo_logprobs(ctx.tokenizer, first.prompt_token_ids, first.prompt_logprobs, echo_top_n)
            logprobs = joined_logprobs(prompt, logprobs)
        choice = {"index": index, "text": echo + result.text, "logprobs": logprobs,
                  "finish_reason": result.finish_reason}
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(ctx.tokenizer, first.prompt_logprobs,
                                                             body.prompt_logprobs)
        choices.append(choice)
    payload = {
        "id": response_id, "object": "text_completion", "created": created, "model": ctx.model_name,
        "choices": choices, "usage": _usage(generations),
    }
    return _json_response(prepared.answer(payload))


def chat_prompt_ids(ctx: PromptSource, body: ChatCompletionRequest, max_tokens: int | None = None) -> list[int]:
    """The conversation's prompt ids; over ``max_tokens`` by its length alone: ``PromptTooLongError``
    before tokenizing (``Tokenizer.encode_chat``)."""
    check_messages(len(body.messages))
    check_tools(len(body.tools or ()))
    check_chat_contents(body.messages)
    tools = msgspec.to_builtins(body.tools) if body.tools else None
    messages = adapt_conversation(template_messages(body.messages), tools, ctx.tokenizer.chat_template_source,
                                  ctx.tool_syntax)
    try:
        return ctx.tokenizer.encode_chat(
            messages, tools=tools, max_tokens=max_tokens,
            add_generation_prompt=body.add_generation_prompt, template_kwargs=body.chat_template_kwargs,
            continue_final_message=body.continue_final_message,
        )
    except ChatTemplateError as exc:
        raise InvalidRequestError(str(exc), param="messages") from exc


def check_prefill(body: ChatCompletionRequest) -> None:
    """vLLM's rules for continuing the last message (assistant prefill): it must be an assistant's,
    and no generation prompt is added after it."""
    if not body.continue_final_message:
        return
    if body.add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true: set "
                                  "add_generation_prompt to false to continue the last message",
                                  param="continue_final_message")
    role = body.messages[-1].role if body.messages else None
    if role != "assistant":
        raise InvalidRequestError(f"continue_final_message continues the last message, which must be an "
                                  f"assistant's; the last message is {role!r}", param="continue_final_message")


class ChatApi:
    """A /v1/chat/completions body on the one preparation path (``api.prepare``)."""

    def __init__(self, body: ChatCompletionRequest) -> None:
        self.body = body
        self.tool_policy = ToolPolicy()  # the body's, once check() has read it
        self.num_choices = 1  # the body's n, once check() has read it (a ctx leg's is 1)

    def check(self, ctx: ServingContext, leg: DisaggLeg | None) -> None:
        body = self.body
        check_choices(body.n)
        self.num_choices = _num_choices(body.n, leg)
        check_prefill(body)
        check_prompt_logprobs(body.prompt_logprobs, body.stream)
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=true", param="top_logprobs")
        self.tool_policy = openai_tool_policy(body)

    def stop_strings(self) -> tuple[str, ...]:
        return stop_strings(self.body.stop, "stop")

    def prompt_ids(self, ctx: ServingContext) -> list[int]:
        return chat_prompt_ids(ctx, self.body, ctx.client.max_model_len)

    def sampling_params(self, ctx: ServingContext, num_prompt_tokens: int) -> SamplingParams:
        body = self.body
        max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        guided, guided_param = ctx.answer_grammar(self.tool_policy, *openai_guided(body))
        return ctx.sampling_params(
            num_prompt_tokens, max_tokens, max_tokens_param=max_tokens_param, prompt_param="messages",
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
            min_tokens=body.min_tokens, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None, guided=guided, guided_param=guided_param,
            prompt_logprobs=body.prompt_logprobs, **openai_controls(body, ctx.client.vocab_size),
        )


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    arrival_time = time.time()
    x_request_id = enter_request(request.scope)
    body = decode_request(await read_body(request.receive), ChatCompletionRequest,
                          ctx.config.strict_request_fields, request.scope)
    return await serve_chat_completion(ctx, body, request.receive, arrival_time, x_request_id)


async def serve_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, receive: Receive,
                                arrival_time: float, x_request_id: str | None = None) -> Response:
    """A decoded chat request to its answer (the Responses API runs through here too);
    ``x_request_id``: the HTTP request's header, for its perf record."""
    api = ChatApi(body)
    prepared = prepare_request(ctx, api, arrival_time, x_request_id)
    generations = choice_generations(prepared.generation, api.num_choices)
    response_id, created = prepared.response_ids(ctx, "chatcmpl")
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        closes = len(generations) == 1
        chunks = [ChatChunkEncoder(response_id, created, ctx.model_name, index) for index in range(len(generations))]
        encoders: list[StreamEncoder] = []
        for chunk in chunks:  # a parser per choice: each holds its choice's calls
            parser = api.tool_policy.parser(ctx.tool_syntax, streaming=True)
            encoder: StreamEncoder = _ChatStream(chunk, ctx.tokenizer, include_usage and closes, closes)
            encoders.append(encoder if parser is None else ToolCallChatStream(encoder, chunk, parser))
        if closes:
            return stream_response(generations[0], encoders[0])
        return EventStreamResponse(stream_choices(
            generations, encoders, lambda: _stream_usage(chunks[0], generations, include_usage), _error_frames))
    choices = []
    for index, result in enumerate(await _collect(receive, generations)):
        parser = api.tool_policy.parser(ctx.tool_syntax, streaming=False)
        logprobs = chat_logprobs(ctx.tokenizer, result.logprobs) if result.logprobs is not None else None
        message, num_calls = ({"role": "assistant", "content": result.text}, 0) if parser is None \
            else chat_message(result.text, parser, result.finish_reason)
        choices.append({"index": index, "message": message, "logprobs": logprobs,
                        "finish_reason": finish_reason(result.finish_reason, num_calls)})
    payload = {
        "id": response_id, "object": "chat.completion", "created": created, "model": ctx.model_name,
        "choices": choices, "usage": _usage(generations),
    }
    if body.prompt_logprobs is not None:  # on the response, where vLLM puts a chat answer's
        payload["prompt_logprobs"] = vllm_prompt_logprobs(ctx.tokenizer, generations[0].prompt_logprobs,
                                                          body.prompt_logprobs)
    return _json_response(prepared.answer(payload))


async def list_models(ctx: ServingContext, request: Request) -> Response:
    model = {
        "id": ctx.model_name, "object": "model", "created": 0, "owned_by": "disagg",
        "max_model_len": ctx.client.max_model_len,
    }
    return _json_response({"object": "list", "data": [model]})
