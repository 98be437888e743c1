"""Llama 3 JSON tool calls: ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``.

Llama 3.1/3.2/3.3 write a call as a bare JSON object at the start of the
answer (or of a line); several calls are separated by ``;`` (3.2) or just
follow each other. A candidate that does not begin like ``{"name"`` is text
at once, so an ordinary JSON answer is not held back for long.
"""

from __future__ import annotations

import json
from typing import Any

from api.tool_parsers.base import Complete, Malformed, NeedMore, ScanResult
from api.tool_parsers.hermes import call_schema
from api.tool_parsers.json_text import (
    CallPrefix,
    ObjectEnd,
    arguments_text,
    partial_suffix,
    read_call,
    read_call_prefix,
)

__all__ = ["Llama3JsonSyntax"]

PYTHON_TAG = "<|python_tag|>"
_KEY = '"name"'
_BLANK = " \t\r"
_ARGUMENT_KEYS = ("parameters", "arguments")
SEPARATOR = '"; "'  # between parallel calls, in Lark (Llama 3.2)


class Llama3JsonSyntax:
    name = "llama3_json"

    def call_start(self, text: str, at_boundary: bool) -> int:
        index = text.find("{")
        while index >= 0:
            before = text[:index].rstrip(_BLANK)
            if before.endswith(PYTHON_TAG):
                before = before[: -len(PYTHON_TAG)].rstrip(_BLANK)
            if (not before and at_boundary) or before.endswith(("\n", ";")):
                return index
            index = text.find("{", index + 1)
        return -1

    def held_suffix(self, text: str) -> int:
        return partial_suffix(text, PYTHON_TAG)

    def is_filler(self, text: str) -> bool:
        return not text.replace(PYTHON_TAG, "").strip(_BLANK + "\n;")

    def filler_start(self, text: str) -> int:
        end = len(text)
        while True:
            stripped = text[:end].rstrip(_BLANK + "\n;")
            if stripped.endswith(PYTHON_TAG):
                stripped = stripped[: -len(PYTHON_TAG)]
            if len(stripped) == end:
                return end
            end = len(stripped)

    def call_prefix(self, text: str) -> CallPrefix | None:
        return read_call_prefix(text, "", _ARGUMENT_KEYS)

    def scan(self, text: str, final: bool, tool_names: frozenset[str], objects: ObjectEnd) -> ScanResult:
        # ``text`` starts with "{": does it go on like '{"name"'?
        head = text[1:64].lstrip(_BLANK + "\n")[: len(_KEY)]  # (a bounded slice: this runs per token)
        if not _KEY.startswith(head):
            return Malformed(1)
        end = objects.find(text, 0) if len(head) == len(_KEY) else -1
        if end < 0:
            return NeedMore()
        call = read_call(text[:end], tool_names, _ARGUMENT_KEYS)
        if call is None:
            return Malformed(end)
        return Complete(call[0], call[1], end)

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return ("You can call these functions. To call one, answer with only a JSON object "
                '{"name": <function-name>, "parameters": <args-json-object>}; several calls are separated '
                f"by \"; \".\n{listed}")

    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "; ".join(f'{{"name": {json.dumps(name)}, "parameters": {arguments_text(arguments)}}}'
                         for name, arguments in calls)

    def render_result(self, content: str) -> str:
        return content

    def grammar(self, tools: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        rules = ["start: " + ("call (" + SEPARATOR + " call)*" if parallel else "call"),
                 "call: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
        for i, (name, schema) in enumerate(tools):
            rules.append(f"fn_{i}: %json{json.dumps(call_schema(name, 'parameters', schema))}")
        return "\n".join(rules) + "\n"
