"""Anthropic Messages API bodies: msgspec request structs and SSE event encoders.

Event sequence of a stream: ``message_start``, ``content_block_start``,
``ping``, ``content_block_delta``*, ``content_block_stop``,
``message_delta`` (stop_reason, stop_sequence, usage), ``message_stop``.
The fixed events are constant bytes; a delta encodes only its text.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from api.structured import OutputConfig
from workers.disagg_params import DisaggParams

__all__ = [
    "TextBlock",
    "ToolUseBlock",
    "ToolResultBlock",
    "ThinkingBlock",
    "RedactedThinkingBlock",
    "ContentBlock",
    "Message",
    "ThinkingEnabled",
    "ThinkingDisabled",
    "ThinkingAdaptive",
    "ThinkingConfig",
    "ToolDefinition",
    "MessagesRequest",
    "CountTokensRequest",
    "MessageEventEncoder",
    "STOP_REASONS",
]

_encode = msgspec.json.encode

# Generation finish reasons (api.generation.Piece) to Anthropic stop reasons;
# a stop string is "stop_sequence", decided where the piece carries one.
STOP_REASONS: dict[str, str] = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class TextBlock(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    text: str
    cache_control: Any = None
    citations: Any = None


class ToolUseBlock(msgspec.Struct, frozen=True, tag_field="type", tag="tool_use"):
    """A call the assistant made (history)."""

    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None


class ToolResultBlock(msgspec.Struct, frozen=True, tag_field="type", tag="tool_result"):
    """A call's result, in a user message (history)."""

    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False
    cache_control: Any = None


class ThinkingBlock(msgspec.Struct, frozen=True, tag_field="type", tag="thinking"):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, frozen=True, tag_field="type", tag="redacted_thinking"):
    data: str


ContentBlock = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class Message(msgspec.Struct, frozen=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolDefinition(msgspec.Struct, frozen=True):
    name: str
    # Required of a custom tool; optional here so that a server tool (which has none) is refused
    # for what it is (api.anthropic_tools), not for a missing field.
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None  # "custom" or absent: client tools are the only kind served
    cache_control: Any = None


class ThinkingEnabled(msgspec.Struct, frozen=True, tag_field="type", tag="enabled"):
    budget_tokens: int


class ThinkingDisabled(msgspec.Struct, frozen=True, tag_field="type", tag="disabled"):
    pass


class ThinkingAdaptive(msgspec.Struct, frozen=True, tag_field="type", tag="adaptive"):
    pass


ThinkingConfig = ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive


class MessagesRequest(msgspec.Struct, frozen=True):
    model: str
    messages: list[Message]
    max_tokens: int
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Any = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Any = None  # {"type": "auto" | "any" | "tool" | "none", ...}: api.anthropic_tools
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None  # structured output: api.structured
    stream_interval: int | None = None  # tokens per content delta after the first (an extension; 1 to 1024)
    priority: int = 0  # vLLM's: the engine's queue serves lower values first (an extension)
    disaggregated_params: DisaggParams | None = None  # a disaggregated leg: api.disaggregation


class CountTokensRequest(msgspec.Struct, frozen=True):
    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Any = None
    thinking: ThinkingConfig | None = None


def usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens NOT read from the prefix cache
    (the whole prompt is input + cache_read + cache_creation, as in Anthropic's prompt caching);
    nothing is ever written to a cache on request, so ``cache_creation_input_tokens`` is 0."""
    return {"input_tokens": input_tokens - cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens, "output_tokens": output_tokens}


def _event(name: str, payload: bytes) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + payload + b"\n\n"


_CONTENT_BLOCK_START = _event(
    "content_block_start", b'{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}'
)
_PING = _event("ping", b'{"type":"ping"}')
_CONTENT_BLOCK_STOP = _event("content_block_stop", b'{"type":"content_block_stop","index":0}')
_MESSAGE_STOP = _event("message_stop", b'{"type":"message_stop"}')
_DELTA_HEAD = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":'
)


class MessageEventEncoder:
    __slots__ = ("message_id", "model")

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model

    def message_start(self, input_tokens: int, cached_tokens: int = 0) -> bytes:
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(input_tokens, 0, cached_tokens),
        }
        return _event("message_start", _encode({"type": "message_start", "message": message}))

    def content_block_start(self) -> bytes:
        return _CONTENT_BLOCK_START

    def ping(self) -> bytes:
        return _PING

    def text_delta(self, text: str) -> bytes:
        return _DELTA_HEAD + _encode(text) + b"}}\n\n"

    def content_block_stop(self) -> bytes:
        return _CONTENT_BLOCK_STOP

    def message_delta(self, stop_reason: str, stop_sequence: str | None, input_tokens: int,
                      output_tokens: int, cached_tokens: int = 0) -> bytes:
        # Usage here is cumulative and final (the SDKs overwrite message_start's with it).
        payload = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": usage(input_tokens, output_tokens, cached_tokens),
        }
        return _event("message_delta", _encode(payload))

    def message_stop(self) -> bytes:
        return _MESSAGE_STOP

    def error(self, error_body: bytes) -> bytes:
        return _event("error", error_body)

    # Blocks at any index (answers with tool calls: text and tool_use blocks in the model's order).

    def block_start(self, index: int, block: dict[str, Any]) -> bytes:
        payload = {"type": "content_block_start", "index": index, "content_block": block}
        return _event("content_block_start", _encode(payload))

    def block_delta(self, index: int, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", _encode({"type": "content_block_delta", "index": index, "delta": delta}))

    def block_stop(self, index: int) -> bytes:
        return _event("content_block_stop", b'{"type":"content_block_stop","index":' + str(index).encode() + b"}")

    def message(self, text: str, stop_reason: str, stop_sequence: str | None, input_tokens: int,
                output_tokens: int, cached_tokens: int = 0, content: list[dict[str, Any]] | None = None) -> bytes:
        """The whole non-streaming response (``content``: its blocks, when not one text block)."""
        return _encode({
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [{"type": "text", "text": text}] if content is None else content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage(input_tokens, output_tokens, cached_tokens),
        })
