"""Tool calling on /v1/chat/completions: the body's tools as a ToolPolicy, the history for
the chat template, and the answer's calls as ``message.tool_calls`` or ``delta.tool_calls``.

Streaming: a call goes out when the parser has read it whole (a partial call
never leaks as content), as two chunks: ``index``, ``id``, ``type`` and
``function.name`` (arguments ``""``) first, then the arguments as one
fragment; a forced call (its form guaranteed by its grammar) goes out as it
is written: the name first, then argument fragments as the model writes them.
``finish_reason`` is ``tool_calls`` when the answer holds a call
and ended normally (``length`` stays ``length``). A call that ``max_tokens``
cut is a call whose ``arguments`` are the JSON text written so far, streamed
or not.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from api.errors import ApiError, InvalidRequestError
from api.generation import Generation, Piece, StreamEncoder
from api.schemas_openai import ChatChunkEncoder, ChatCompletionRequest, ChatMessage
from api.tool_calls import AUTO, NAMED, NONE, REQUIRED, ToolPolicy, check_named_tool, check_tool_schemas, tool_spec
from api.tool_parsers import ArgumentsDelta, CallHead, CutCall, ParsedCall, ParserEvent, TextDelta, ToolCallParser

__all__ = ["template_messages", "openai_tool_policy", "ToolCallChatStream", "chat_message", "finish_reason", "call_id"]

_CHOICES = {"auto": AUTO, "none": NONE, "required": REQUIRED}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as chat templates expect it (the shape ``apply_chat_template`` takes)."""
    rendered = []
    for message in messages:
        entry = msgspec.to_builtins(message)
        if message.role == "developer":  # OpenAI's newer name for the system message
            entry["role"] = "system"
        if isinstance(message.content, list):  # most templates expect string content
            entry["content"] = "\n".join(part.text for part in message.content)
        if message.tool_calls:
            # Templates write arguments with ``| tojson``: give them the object, as vLLM does.
            for call in entry["tool_calls"]:
                call["function"]["arguments"] = _arguments_object(call["function"]["arguments"])
        rendered.append(entry)
    return rendered


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # not JSON: the template gets the string as the client sent it


def openai_tool_policy(body: ChatCompletionRequest) -> ToolPolicy:
    """The body's tools, tool_choice and parallel_tool_calls, validated (400 naming the field)."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise InvalidRequestError("tool_choice requires tools", param="tool_choice")
        return ToolPolicy()
    tools = tuple(tool_spec(t.function.name, t.function.parameters, f"tools[{i}].function.parameters",
                            f"tools[{i}].function.name") for i, t in enumerate(body.tools))
    check_tool_schemas(list(tools))
    parallel = body.parallel_tool_calls
    if choice is None:
        return ToolPolicy(tools, AUTO, parallel=parallel)
    if isinstance(choice, str):
        if choice not in _CHOICES:
            raise InvalidRequestError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}",
                                      param="tool_choice")
        return ToolPolicy(tools, _CHOICES[choice], parallel=parallel)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequestError('tool_choice must be a string or {"type": "function", "function": {"name": ...}}',
                                  param="tool_choice")
    check_named_tool(tools, name, "tool_choice.function.name")
    return ToolPolicy(tools, NAMED, name=name, parallel=parallel)


def finish_reason(reason: str | None, num_calls: int) -> str:
    if num_calls and reason == "stop":
        return "tool_calls"
    return reason or "stop"


def chat_message(text: str, parser: ToolCallParser, finish_reason: str | None) -> tuple[dict[str, Any], int]:
    """The non-streaming ``message`` of an answer parsed for calls, and how many it holds."""
    events = parser.parse(text, cut=finish_reason == "length")
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls = [_call_object(e) for e in events if isinstance(e, (ParsedCall, CutCall))]
    if not calls:
        return {"role": "assistant", "content": content}, 0
    return {"role": "assistant", "content": content or None, "tool_calls": calls}, len(calls)


def _call_object(call: ParsedCall | CutCall) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}


class ToolCallChatStream:
    """A chat stream encoder (``inner``) with the answer parsed for tool calls."""

    def __init__(self, inner: StreamEncoder, encoder: ChatChunkEncoder, parser: ToolCallParser) -> None:
        self.inner = inner
        self.encoder = encoder
        self.parser = parser
        self.streamed_call: int | None = None  # the call whose head went out before its end

    def start(self, generation: Generation) -> list[bytes]:
        return self.inner.start(generation)

    def piece(self, piece: Piece) -> bytes | None:
        return self._frames(self.parser.feed(piece.text)) or None

    def finish(self, generation: Generation, last: Piece) -> list[bytes]:
        frames = self._frames(self.parser.finish(cut=last.finish_reason == "length"))
        reason = finish_reason(last.finish_reason, self.parser.num_calls)
        ending = Piece("", [], None, reason, last.stop_string)
        return ([frames] if frames else []) + self.inner.finish(generation, ending)

    def error(self, error: ApiError) -> list[bytes]:
        return self.inner.error(error)

    def _frames(self, events: list[ParserEvent]) -> bytes:
        encoder, frames = self.encoder, []
        for event in events:
            if isinstance(event, TextDelta):
                frames.append(encoder.content(event.text))
            elif isinstance(event, CallHead):
                self.streamed_call = event.index
                frames.append(encoder.tool_call_start(event.index, call_id(), event.name))
            elif isinstance(event, ArgumentsDelta):
                frames.append(encoder.tool_call_arguments(event.index, event.text))
            elif event.index != self.streamed_call:  # a streamed call's end only ends it
                frames.append(encoder.tool_call_start(event.index, call_id(), event.name))
                if event.arguments_json:  # a call cut before its arguments has none
                    frames.append(encoder.tool_call_arguments(event.index, event.arguments_json))
        return b"".join(frames)
