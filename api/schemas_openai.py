"""OpenAI API bodies: msgspec request structs and response/chunk encoders.

Requests decode with ``msgspec.json.decode(body, type=...)``: strict types
(a string where a number belongs is a 400 that names the field), unknown
fields ignored. Streaming chunks are built from byte templates made once
per request; per token only the text is JSON-encoded.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from api.structured import ResponseFormat, StructuredOutputs
from api.tokenizer import Tokenizer
from workers.disagg_params import DisaggParams
from workers.protocol import TokenLogprobs

__all__ = [
    "StreamOptions",
    "CompletionRequest",
    "TextPart",
    "ToolCallFunction",
    "ToolCall",
    "FunctionDefinition",
    "Tool",
    "ChatMessage",
    "ChatCompletionRequest",
    "Usage",
    "PromptTokensDetails",
    "CompletionChunkEncoder",
    "ChatChunkEncoder",
    "completion_logprobs",
    "chat_logprobs",
    "SSE_DONE",
]

SSE_DONE = b"data: [DONE]\n\n"
_CONTENT_TAIL = b'},"logprobs":null,"finish_reason":null}]}\n\n'
_encode = msgspec.json.encode


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class SamplingControls(msgspec.Struct, frozen=True, kw_only=True):
    """Structured output and sampling controls that both generation endpoints take
    (read by api.structured); keyword-only, so they follow each request's own fields."""

    response_format: ResponseFormat | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    stream_interval: int | None = None  # tokens per SSE event after the first (an extension; 1 to 1024)
    priority: int = 0  # vLLM's: the engine's queue serves lower values first (an extension)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and top-n (api.prompt_logprobs)
    logit_bias: dict[str, float] | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's; and its older guided_* fields
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingControls, frozen=True):
    model: str
    prompt: str | list[int]
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    n: int = 1
    best_of: int | None = None  # accepted equal to n only (api.choices)
    echo: bool = False  # the prompt's text starts each choice's text
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None
    disaggregated_params: DisaggParams | None = None  # a disaggregated leg: api.disaggregation


class TextPart(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    text: str


class ToolCallFunction(msgspec.Struct, frozen=True):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class FunctionDefinition(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    # Field order is the order templates render them in (``tool | tojson``): as clients send it.
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingControls, frozen=True):
    model: str
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    n: int = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    tools: list[Tool] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}: api.openai_tools
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is continued; openai_api.check_prefill
    chat_template_kwargs: dict[str, Any] | None = None
    user: str | None = None
    disaggregated_params: DisaggParams | None = None  # a disaggregated leg: api.disaggregation


class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int = 0
    """Prompt tokens served from a prefix cache (``api.disaggregation`` for disaggregated requests)."""


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


def completion_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprobs], text_offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for some tokens; offsets start at ``text_offset``."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in logprobs:
        token = tokenizer.token_text(entry.token_id)
        tokens.append(token)
        token_logprobs.append(entry.logprob)
        top.append({tokenizer.token_text(t): lp for t, lp in zip(entry.top_token_ids, entry.top_logprobs)})
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprobs]) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for entry in logprobs:
        token = tokenizer.token_text(entry.token_id)
        top = []
        for top_id, top_logprob in zip(entry.top_token_ids, entry.top_logprobs):
            top_token = tokenizer.token_text(top_id)
            top.append({"token": top_token, "logprob": top_logprob, "bytes": list(top_token.encode())})
        content.append({"token": token, "logprob": entry.logprob, "bytes": list(token.encode()), "top_logprobs": top})
    return {"content": content}


class _ChunkTemplates:
    """``data: {"id":...,"object":...,"created":...,"model":...,"choices":`` once per request."""

    __slots__ = ("head",)

    def __init__(self, response_id: str, object_name: str, created: int, model: str) -> None:
        self.head = (
            b'data: {"id":' + _encode(response_id) + b',"object":"' + object_name.encode() + b'","created":'
            + str(created).encode() + b',"model":' + _encode(model) + b',"choices":'
        )

    def usage(self, usage: Usage) -> bytes:
        return self.head + b'[],"usage":' + _encode(usage) + b"}\n\n"


def _choice_head(head: bytes, index: int) -> bytes:
    """``...,"choices":[{"index":<index>,``: every chunk of one choice (``n`` > 1 streams several)."""
    return head + b'[{"index":' + str(index).encode() + b","


class CompletionChunkEncoder(_ChunkTemplates):
    __slots__ = ("_text_head",)

    def __init__(self, response_id: str, created: int, model: str, index: int = 0) -> None:
        super().__init__(response_id, "text_completion", created, model)
        self._text_head = _choice_head(self.head, index) + b'"text":'

    def text(self, text: str, logprobs: dict[str, Any] | None = None, finish_reason: str | None = None) -> bytes:
        return (
            self._text_head + _encode(text) + b',"logprobs":' + _encode(logprobs) + b',"finish_reason":'
            + _encode(finish_reason) + b"}]}\n\n"
        )


class ChatChunkEncoder(_ChunkTemplates):
    __slots__ = ("_choice", "_content_head")

    def __init__(self, response_id: str, created: int, model: str, index: int = 0) -> None:
        super().__init__(response_id, "chat.completion.chunk", created, model)
        self._choice = _choice_head(self.head, index)
        self._content_head = self._choice + b'"delta":{"content":'

    def role(self) -> bytes:
        return (self._choice + b'"delta":{"role":"assistant","content":""},"logprobs":null,'
                b'"finish_reason":null}]}\n\n')

    def content(self, text: str, logprobs: dict[str, Any] | None = None) -> bytes:
        if logprobs is None:  # the common event: one encode, the rest preallocated
            return self._content_head + _encode(text) + _CONTENT_TAIL
        return (self._content_head + _encode(text) + b'},"logprobs":' + _encode(logprobs)
                + b',"finish_reason":null}]}\n\n')

    def tool_call_start(self, index: int, call_id: str, name: str) -> bytes:
        call = {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        return self._tool_call(call)

    def tool_call_arguments(self, index: int, arguments: str) -> bytes:
        return self._tool_call({"index": index, "function": {"arguments": arguments}})

    def _tool_call(self, call: dict[str, Any]) -> bytes:
        return (self._choice + b'"delta":{"tool_calls":[' + _encode(call)
                + b']},"logprobs":null,"finish_reason":null}]}\n\n')

    def finish(self, finish_reason: str) -> bytes:
        return (self._choice + b'"delta":{},"logprobs":null,"finish_reason":' + _encode(finish_reason)
                + b"}]}\n\n")
