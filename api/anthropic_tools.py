"""Tool use on /v1/messages: the history's blocks for the chat template, tool_choice and
thinking checked, and the answer's calls as ``tool_use`` blocks.

History goes through the model's chat template the way vLLM converts it
(the template expects OpenAI-style messages): an assistant's ``tool_use``
blocks become its ``tool_calls`` (``input`` as the arguments object), a
user's ``tool_result`` blocks become ``tool`` messages before that user's
text (an error result's text starts with ``Error: ``), ``thinking`` becomes
the assistant's ``reasoning_content`` (what reasoning templates read) and
``redacted_thinking`` is dropped (it is opaque).

``thinking`` as a parameter is validated as Anthropic does (``budget_tokens``
>= 1024 and below ``max_tokens``; no forced tool use with thinking on) and
otherwise has no effect: the served models have no reasoning format, so an
answer holds no ``thinking`` blocks.

Streaming: blocks open in the order the model writes them; a text block
streams as the text comes, a ``tool_use`` block is sent whole once its call
is complete (``content_block_start`` with empty ``input``, one
``input_json_delta`` with the arguments, ``content_block_stop``), or, for a
forced call (its form guaranteed by its grammar), as it is written: the
block starts when its name is read and each argument fragment is an
``input_json_delta``. Every block started is stopped, one index each. A call
that ``max_tokens`` cut is a ``tool_use`` block whose ``input`` holds the
arguments' complete values so far, as the SDKs assemble the same call
streamed (``api.tool_parsers.partial_json``).
"""

from __future__ import annotations

import uuid
from typing import Any

from api.errors import ApiError, InvalidRequestError, anthropic_error_body
from api.generation import Generation, Piece
from api.schemas_anthropic import (
    STOP_REASONS,
    CountTokensRequest,
    MessageEventEncoder,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ThinkingEnabled,
    ToolResultBlock,
    ToolUseBlock,
)
from api.tool_calls import AUTO, NAMED, NONE, REQUIRED, ToolPolicy, check_named_tool, check_tool_schemas, tool_spec
from api.tool_parsers import ArgumentsDelta, CallHead, CutCall, ParsedCall, ParserEvent, TextDelta, ToolCallParser

__all__ = ["template_messages", "prefill_text", "anthropic_tool_policy", "check_thinking", "stop_reason",
           "message_content",
           "ToolUseMessageStream"]

_MIN_THINKING_BUDGET = 1024
_CHOICES = {"auto": AUTO, "any": REQUIRED, "tool": NAMED, "none": NONE}


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _text(content: str | list[TextBlock] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "\n".join(block.text for block in content)


def template_messages(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI-style messages for the chat template (system first)."""
    messages: list[dict[str, Any]] = []
    if body.system is not None:
        messages.append({"role": "system", "content": _text(body.system)})
    for index, message in enumerate(body.messages):
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            messages.extend(_user_messages(message.content, index))
        else:
            messages.append(_assistant_message(message.content, index))
    return messages


def _user_messages(blocks: list[Any], index: int) -> list[dict[str, Any]]:
    results, texts = [], []
    for position, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            content = _text(block.content)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {content}" if block.is_error else content})
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        elif not isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            raise InvalidRequestError(f"a user message cannot hold a {type(block).__name__} block",
                                      param=f"messages[{index}].content[{position}]")
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def _assistant_message(blocks: list[Any], index: int) -> dict[str, Any]:
    texts, calls, reasoning = [], [], []
    for position, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            function = {"name": block.name, "arguments": block.input}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolResultBlock):
            raise InvalidRequestError("tool_result blocks belong in user messages",
                                      param=f"messages[{index}].content[{position}]")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return message


def prefill_text(body: MessagesRequest | CountTokensRequest) -> str | None:
    """The text an assistant turn is prefilled with (the conversation ends with it), or None."""
    last = body.messages[-1] if body.messages else None
    if last is None or last.role != "assistant":
        return None
    if isinstance(last.content, str):
        return last.content
    if any(isinstance(block, ToolUseBlock) for block in last.content):
        raise InvalidRequestError("the final assistant message cannot end with tool_use; send its tool_result",
                                  param=f"messages[{len(body.messages) - 1}].content")
    return "\n".join(block.text for block in last.content if isinstance(block, TextBlock))


def anthropic_tool_policy(body: MessagesRequest | CountTokensRequest) -> ToolPolicy:
    """The body's tools and tool_choice, validated (400 naming the field)."""
    choice = body.tool_choice
    if choice is not None and (not isinstance(choice, dict) or choice.get("type") not in _CHOICES):
        raise InvalidRequestError("tool_choice.type must be one of 'auto', 'any', 'tool', 'none'",
                                  param="tool_choice.type")
    if not body.tools:
        if choice is not None and choice["type"] != "none":
            raise InvalidRequestError("tool_choice requires tools", param="tool_choice")
        return ToolPolicy()
    for i, tool in enumerate(body.tools):
        if tool.type not in (None, "custom"):
            raise InvalidRequestError(
                f"server tools are not supported: tools[{i}] ({tool.name!r}) has type {tool.type!r}, a tool that "
                "Anthropic's API defines and runs; pass a custom tool instead (a name, a description and an "
                "input_schema) and run it in your client", param=f"tools[{i}].type")
        if tool.input_schema is None:
            raise InvalidRequestError(f"tools[{i}] ({tool.name!r}) needs an input_schema (a JSON schema of its input)",
                                      param=f"tools[{i}].input_schema")
    tools = tuple(tool_spec(t.name, t.input_schema, f"tools[{i}].input_schema", f"tools[{i}].name")
                  for i, t in enumerate(body.tools))
    check_tool_schemas(list(tools))
    if choice is None:
        return ToolPolicy(tools, AUTO)
    disable_parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(disable_parallel, bool):
        raise InvalidRequestError("disable_parallel_tool_use must be a boolean",
                                  param="tool_choice.disable_parallel_tool_use")
    mode, name = _CHOICES[choice["type"]], None
    if mode == NAMED:
        name = choice.get("name")
        if not isinstance(name, str):
            raise InvalidRequestError("tool_choice of type 'tool' needs a name", param="tool_choice.name")
        check_named_tool(tools, name, "tool_choice.name")
    return ToolPolicy(tools, mode, name=name, parallel=not disable_parallel)


def check_thinking(body: MessagesRequest, policy: ToolPolicy, check_budget: bool = True) -> None:
    """``check_budget``: False on a disaggregated ctx leg, whose max_tokens is the orchestrator's 1."""
    thinking = body.thinking
    if not isinstance(thinking, ThinkingEnabled):
        return
    if thinking.budget_tokens < _MIN_THINKING_BUDGET:
        raise InvalidRequestError(f"thinking.budget_tokens must be >= {_MIN_THINKING_BUDGET}, "
                                  f"got {thinking.budget_tokens}", param="thinking.budget_tokens")
    if check_budget and thinking.budget_tokens >= body.max_tokens:
        raise InvalidRequestError(f"thinking.budget_tokens must be less than max_tokens ({body.max_tokens}), "
                                  f"got {thinking.budget_tokens}", param="thinking.budget_tokens")
    if policy.is_forced:
        raise InvalidRequestError("thinking may not be enabled when tool_choice forces tool use",
                                  param="tool_choice")


def stop_reason(finish_reason: str | None, stop_string: str | None, num_calls: int = 0) -> str:
    if stop_string is not None:
        return "stop_sequence"
    if num_calls and finish_reason in (None, "stop"):
        return "tool_use"
    return STOP_REASONS.get(finish_reason or "stop", "end_turn")


def message_content(text: str, parser: ToolCallParser, finish_reason: str | None) -> list[dict[str, Any]]:
    """The ``content`` blocks of a whole answer parsed for calls."""
    blocks: list[dict[str, Any]] = []
    for event in parser.parse(text, cut=finish_reason == "length"):
        if isinstance(event, TextDelta):
            if blocks and blocks[-1]["type"] == "text":
                blocks[-1]["text"] += event.text
            else:
                blocks.append({"type": "text", "text": event.text})
        elif isinstance(event, (ParsedCall, CutCall)):
            blocks.append({"type": "tool_use", "id": tool_use_id(), "name": event.name, "input": event.arguments})
    return blocks or [{"type": "text", "text": ""}]


class ToolUseMessageStream:
    """The /v1/messages event stream of an answer parsed for tool calls."""

    def __init__(self, encoder: MessageEventEncoder, parser: ToolCallParser) -> None:
        self.encoder = encoder
        self.parser = parser
        self.index = 0  # of the open block, or of the next one
        self.text_open = False
        self.tool_open = False  # a streamed call's tool_use block

    def start(self, generation: Generation) -> list[bytes]:
        return [self.encoder.message_start(generation.num_prompt_tokens, generation.num_usage_cached_tokens),
                self.encoder.ping()]

    def piece(self, piece: Piece) -> bytes | None:
        return self._frames(self.parser.feed(piece.text)) or None

    def finish(self, generation: Generation, last: Piece) -> list[bytes]:
        encoder = self.encoder
        frames = [self._frames(self.parser.finish(cut=last.finish_reason == "length"))]
        if self.index == 0 and not (self.text_open or self.tool_open):  # nothing: one empty text block
            frames.append(self._open_text())
        if self.text_open or self.tool_open:  # the last block (the parser ends every call it started)
            frames.append(encoder.block_stop(self.index))
        reason = stop_reason(last.finish_reason, last.stop_string, self.parser.num_calls)
        frames.append(encoder.message_delta(reason, last.stop_string, generation.num_prompt_tokens,
                                            generation.num_output_tokens, generation.num_usage_cached_tokens))
        frames.append(encoder.message_stop())
        return frames

    def error(self, error: ApiError) -> list[bytes]:
        return [self.encoder.error(anthropic_error_body(error))]

    def _open_text(self) -> bytes:
        self.text_open = True
        return self.encoder.block_start(self.index, {"type": "text", "text": ""})

    def _frames(self, events: list[ParserEvent]) -> bytes:
        encoder, frames = self.encoder, []
        for event in events:
            if isinstance(event, TextDelta):
                if not self.text_open:
                    frames.append(self._open_text())
                frames.append(encoder.block_delta(self.index, {"type": "text_delta", "text": event.text}))
            elif isinstance(event, ArgumentsDelta):
                frames.append(encoder.block_delta(self.index, {"type": "input_json_delta", "partial_json": event.text}))
            elif isinstance(event, CallHead):
                frames.append(self._close_text() + self._open_tool_use(event.name))
            else:  # a call's end (whole or cut): a streamed call's only ends its block
                if not self.tool_open:
                    frames.append(self._close_text() + self._open_tool_use(event.name))
                    if event.arguments_json:  # a call cut before its arguments has none
                        frames.append(encoder.block_delta(self.index, {"type": "input_json_delta",
                                                                       "partial_json": event.arguments_json}))
                frames.append(encoder.block_stop(self.index))
                self.tool_open = False
                self.index += 1
        return b"".join(frames)

    def _close_text(self) -> bytes:
        if not self.text_open:
            return b""
        self.text_open = False
        self.index += 1
        return self.encoder.block_stop(self.index - 1)

    def _open_tool_use(self, name: str) -> bytes:
        self.tool_open = True
        block = {"type": "tool_use", "id": tool_use_id(), "name": name, "input": {}}
        return self.encoder.block_start(self.index, block)
