"""Hermes / Qwen / ChatML tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Used by Hermes-2/3, Qwen2/2.5/3 and ChatML models such as SmolLM2. Several
calls follow each other, usually on separate lines. A missing or partial
closing tag at the very end of the output is accepted (the model stopped
with EOS right after the JSON, or ``max_tokens`` cut the tag).
"""

from __future__ import annotations

import json
from typing import Any

from api.tool_parsers.base import Complete, Malformed, NeedMore, ScanResult
from api.tool_parsers.json_text import (
    CallPrefix,
    ObjectEnd,
    arguments_text,
    partial_suffix,
    read_call,
    read_call_prefix,
)

__all__ = ["HermesSyntax"]

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_WHITESPACE = " \t\r\n"
_ARGUMENT_KEYS = ("arguments", "parameters")
SEPARATOR = '"\\n"'  # between parallel calls, in Lark


class HermesSyntax:
    name = "hermes"

    def call_start(self, text: str, at_boundary: bool) -> int:
        return text.find(OPEN)

    def held_suffix(self, text: str) -> int:
        return partial_suffix(text, OPEN)

    def is_filler(self, text: str) -> bool:
        return not text.strip(_WHITESPACE)

    def filler_start(self, text: str) -> int:
        return len(text.rstrip(_WHITESPACE))

    def call_prefix(self, text: str) -> CallPrefix | None:
        return read_call_prefix(text, OPEN, _ARGUMENT_KEYS)

    def scan(self, text: str, final: bool, tool_names: frozenset[str], objects: ObjectEnd) -> ScanResult:
        body = len(OPEN)
        while body < len(text) and text[body] in _WHITESPACE:
            body += 1
        if body == len(text):
            return NeedMore()
        if text[body] != "{":
            return Malformed(len(OPEN))
        end = objects.find(text, body)
        if end < 0:
            return NeedMore()
        close = end
        while close < len(text) and text[close] in _WHITESPACE:
            close += 1
        tail = text[close:close + len(CLOSE)]
        if tail == CLOSE:
            length = close + len(CLOSE)
        elif not CLOSE.startswith(tail):
            return Malformed(end)
        elif not final:
            return NeedMore()
        else:  # the output ends in (or before) the closing tag: the call itself is whole
            length = len(text)
        call = read_call(text[body:end], tool_names, _ARGUMENT_KEYS)
        if call is None:
            return Malformed(length)
        return Complete(call[0], call[1], length)

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        # Qwen2.5's words: the prompt Hermes-format models were trained on.
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and "
                "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "\n".join(f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments_text(arguments)}}}\n{CLOSE}'
                         for name, arguments in calls)

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def grammar(self, tools: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        rules = ["start: " + ("call (" + SEPARATOR + " call)*" if parallel else "call"),
                 'call: "<tool_call>\\n" body "\\n</tool_call>"',
                 "body: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
        for i, (name, schema) in enumerate(tools):
            rules.append(f"fn_{i}: %json{json.dumps(call_schema(name, 'arguments', schema))}")
        return "\n".join(rules) + "\n"


def call_schema(name: str, arguments_key: str, arguments_schema: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call object, written as json.dumps writes it (no free whitespace:
    a weak model must not spend its tokens on spaces)."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, arguments_key: arguments_schema},
        "required": ["name", arguments_key],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    }
