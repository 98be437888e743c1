"""Responses API bodies (msgspec): the request, its input items, and the stored record.

Input items are a tagged union on ``type``; a message may omit ``type``
(the reference's "easy input message"), which ``parse_input`` fills in
before decoding. Output items reuse the same structs (a response's output
is the next turn's input, unchanged), so what is stored for
``previous_response_id`` is typed end to end. Unknown fields are ignored;
unknown item, part, tool and format types are 400s that name the field.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "OUTPUT_TEXT_LOGPROBS",
    "InputText",
    "OutputText",
    "Refusal",
    "ContentPart",
    "MessageItem",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "ReasoningItem",
    "Item",
    "FunctionTool",
    "ToolChoiceFunction",
    "TextFormatText",
    "TextFormatJsonObject",
    "TextFormatJsonSchema",
    "TextConfig",
    "ResponsesRequest",
    "with_defaults",
    "StoredResponse",
]


OUTPUT_TEXT_LOGPROBS = "message.output_text.logprobs"
"""The ``include`` value that asks for the output text's token logprobs."""


class InputText(msgspec.Struct, frozen=True, tag_field="type", tag="input_text"):
    text: str


class OutputText(msgspec.Struct, frozen=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []


class Refusal(msgspec.Struct, frozen=True, tag_field="type", tag="refusal"):
    refusal: str


ContentPart = InputText | OutputText | Refusal


class MessageItem(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="message"):
    id: str | None = None
    status: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="function_call"):
    id: str | None = None
    call_id: str
    name: str
    arguments: str
    status: str | None = None


class FunctionCallOutputItem(msgspec.Struct, frozen=True, kw_only=True, tag_field="type",
                             tag="function_call_output"):
    id: str | None = None
    call_id: str
    output: str | list[ContentPart]
    status: str | None = None


class ReasoningItem(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="reasoning"):
    """Sent back by agents that replay every output item; this server never produces
    reasoning items, so they carry nothing the model needs and are dropped."""

    id: str | None = None


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="function"):
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ToolChoiceFunction(msgspec.Struct, frozen=True, tag_field="type", tag="function"):
    name: str


class TextFormatText(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    pass


class TextFormatJsonObject(msgspec.Struct, frozen=True, tag_field="type", tag="json_object"):
    pass


class TextFormatJsonSchema(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="json_schema"):
    name: str
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, frozen=True):
    format: TextFormatText | TextFormatJsonObject | TextFormatJsonSchema = TextFormatText()


class ResponsesRequest(msgspec.Struct, frozen=True):
    model: str
    input: str | list[Any]  # items are decoded one by one (``parse_input``): a message may omit ``type``
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    # Clients send null for "the default" as often as they leave a field out: ``with_defaults``.
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceFunction | None = "auto"
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    background: bool | None = False
    truncation: Literal["disabled"] | None = "disabled"
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None  # echoed; nothing to reason with
    user: str | None = None
    include: list[str] | None = None  # only OUTPUT_TEXT_LOGPROBS acts: the others name items never made here
    top_logprobs: int | None = None  # with OUTPUT_TEXT_LOGPROBS
    conversation: Any = None  # a stored conversation object: not supported (a 400 naming it)


def with_defaults(body: ResponsesRequest) -> ResponsesRequest:
    """``body`` with every null that means "the default" replaced by it."""
    defaults = {"tool_choice": "auto", "parallel_tool_calls": True, "store": True, "stream": False,
                "background": False, "truncation": "disabled"}
    nulls = {name: value for name, value in defaults.items() if getattr(body, name) is None}
    return msgspec.structs.replace(body, **nulls) if nulls else body


class StoredResponse(msgspec.Struct, frozen=True):
    """What a store keeps per response: the public object as sent, and the whole conversation
    a follow-up continues (this turn's history, its input and its output, as items, each with
    an id), so that one lookup serves ``previous_response_id`` however long the chain. The
    last ``num_output`` items are the response's output; the ones before, its input items."""

    id: str
    created_at: float
    response: msgspec.Raw
    conversation: list[Item]
    num_output: int = 0
