"""The JSON bodies the apps answer with, as ``msgspec.Struct``s for the OpenAPI schema only.

The handlers build these answers as pre-encoded bytes or dicts (no per-request
Struct cost on the hot path); these types describe them for ``/openapi.json``
(``api.openapi``), and the tests validate live answers against the
schemas generated from them, so a field changed in a handler and not here
fails a test. Request bodies need no twin: their Structs are the ones the
handlers decode with (``schemas_openai``, ``schemas_anthropic``, ...).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from api.batches.schemas import BatchList, CreateBatchRequest, DeletedBatch, MessageBatch
from api.responses.schemas import Item
from api.schemas_openai import Usage

__all__ = [
    "OpenAIError", "AnthropicError", "EmptyBody", "ChatCompletion", "Completion", "ModelList", "ModelCard",
    "AnthropicMessage", "InputTokens", "ResponseObject", "DeletedResponse", "ResponseItemList", "TokenizeResult",
    "DetokenizeResult", "Health", "Version", "WorkerInfo", "ProfileStatus", "BatchList", "CreateBatchRequest",
    "DeletedBatch", "MessageBatch", "ChatCompletionChunk", "CompletionChunk", "MessageStreamEvent",
    "ResponseStreamEvent",
]

# --- errors: the one shape per API (``api.errors``) ---------------------------------------------------


class OpenAIErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    """The request parameter at fault, when one is."""
    code: str | None


class OpenAIError(msgspec.Struct):
    """Every error of an OpenAI-shaped route (4xx and 5xx alike)."""

    error: OpenAIErrorDetail


class AnthropicErrorDetail(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct):
    """Every error of an Anthropic-shaped route (``/v1/messages*``)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class EmptyBody(msgspec.Struct):
    """No body is needed; one that is sent is ignored."""


# --- OpenAI ----------------------------------------------------------------------------------------------


class ToolCallFunctionOut(msgspec.Struct):
    name: str
    arguments: str
    """The call's arguments as a JSON text."""


class ToolCallOut(msgspec.Struct):
    id: str
    type: Literal["function"]
    function: ToolCallFunctionOut


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class _LegFields(msgspec.Struct, kw_only=True):
    disaggregated_params: dict[str, Any] | None = None
    """Only on a context-only leg of a disaggregated request (``api.disaggregation``)."""
    prompt_token_ids: list[int] | None = None
    """Only on a context-only leg."""


class _OpenAIAnswer(_LegFields, kw_only=True):
    id: str
    created: int
    model: str
    usage: Usage


class _Choice(msgspec.Struct, kw_only=True):
    index: int
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatChoice(_Choice, kw_only=True):
    message: AssistantMessage


class ChatCompletion(_OpenAIAnswer, kw_only=True):
    """A non-streaming chat completion. With ``"stream": true`` the answer is instead
    ``text/event-stream``: ``chat.completion.chunk`` objects, then ``data: [DONE]``."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class CompletionChoice(_Choice, kw_only=True):
    text: str


class Completion(_OpenAIAnswer, kw_only=True):
    """A non-streaming completion; with ``"stream": true``, ``text_completion`` chunks over SSE."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = None
    max_model_len: int | None
    """The longest prompt + output this server takes; null until known (the orchestrator before any worker)."""


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResult(msgspec.Struct):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResult(msgspec.Struct):
    prompt: str


# --- Anthropic ------------------------------------------------------------------------------------------


class AnthropicUsage(msgspec.Struct):
    input_tokens: int
    """Prompt tokens not read from the prefix cache."""
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int


class AnthropicMessage(_LegFields, kw_only=True):
    """A non-streaming message; with ``"stream": true``, Anthropic's event stream (``message_start`` ...
    ``message_stop``)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    """Text and ``tool_use`` blocks in the model's order."""
    stop_reason: str | None
    stop_sequence: str | None
    usage: AnthropicUsage


class InputTokens(msgspec.Struct):
    input_tokens: int


# --- Responses ------------------------------------------------------------------------------------------


class ResponseObject(msgspec.Struct, kw_only=True):
    """A response; with ``"stream": true``, the Responses event stream (``response.created`` ...
    ``response.completed``)."""

    id: str
    object: Literal["response"]
    created_at: float
    status: str
    model: str
    output: list[Item]
    usage: dict[str, Any] | None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None


class DeletedResponse(msgspec.Struct):
    id: str
    object: Literal["response"]
    deleted: bool


class ResponseItemList(msgspec.Struct, kw_only=True):
    object: Literal["list"]
    data: list[Item]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


# --- the worker's own routes ----------------------------------------------------------------------------


class Health(msgspec.Struct, kw_only=True, omit_defaults=True):
    status: Literal["ok", "degraded"]
    """degraded: serving, on fewer frontends than configured (one left down by its restart budget)."""
    frontends_left_down: list[int] | None = None
    """degraded: the frontends the launcher no longer respawns."""
    num_frontends: int | None = None
    """degraded: the frontends configured."""


class Version(msgspec.Struct):
    version: str


class WorkerInfo(msgspec.Struct):
    """What an orchestrator needs to route to this worker."""

    role: str
    model: str
    kv_endpoint: str | None
    block_size: int
    hash_seed: int
    max_model_len: int
    vocab_size: int
    server_time: float
    """This worker's clock (Unix seconds): the orchestrator measures the offset from it."""


class ProfileStatus(msgspec.Struct, kw_only=True):
    status: Literal["profiling", "stopped"]
    trace: str | None = None
    """Where the trace was written (``/stop_profile``)."""


# --- stream events: the JSON of each SSE ``data:`` line of a ``"stream": true`` answer ---------------------


class ChatDelta(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """``{index, id, type, function: {name, arguments}}`` first, then ``{index, function: {arguments}}``."""


class ChatChunkChoice(_Choice, kw_only=True):
    delta: ChatDelta


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One event of a chat stream (the last one, with ``stream_options.include_usage``: no choices,
    the usage); the stream ends with ``data: [DONE]``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(msgspec.Struct, kw_only=True):
    """One event of a completion stream; then ``data: [DONE]``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class MessageStart(msgspec.Struct, tag_field="type", tag="message_start"):
    message: AnthropicMessage
    """With no content yet, null stop fields and the input usage."""


class ContentBlockStart(msgspec.Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: dict[str, Any]


class ContentBlockDelta(msgspec.Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: dict[str, Any]
    """``text_delta`` or ``input_json_delta``."""


class ContentBlockStop(msgspec.Struct, tag_field="type", tag="content_block_stop"):
    index: int


class MessageDeltaBody(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(msgspec.Struct, tag_field="type", tag="message_delta"):
    delta: MessageDeltaBody
    usage: AnthropicUsage
    """Cumulative and final."""


class MessageStop(msgspec.Struct, tag_field="type", tag="message_stop"):
    pass


class Ping(msgspec.Struct, tag_field="type", tag="ping"):
    pass


class StreamError(msgspec.Struct, tag_field="type", tag="error"):
    error: AnthropicErrorDetail


MessageStreamEvent = (
    MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop | Ping | StreamError
)


class ResponseStreamEvent(msgspec.Struct, kw_only=True):
    """One event of a Responses stream (``response.created`` ... ``response.completed``); its other
    fields depend on ``type``, as in OpenAI's Responses API."""

    type: str
    sequence_number: int
