"""The JSON text of tool calls, read as it streams: where an object ends, a call's name and
arguments, the head of a call written name first, a held-back opener prefix."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["ObjectEnd", "json_object_end", "read_call", "arguments_text", "CallPrefix", "read_call_prefix",
           "partial_suffix"]


class ObjectEnd:
    """Where the JSON object that opens at ``text[start] == '{'`` ends, for a text that only
    grows between calls: the scan resumes where it stopped, so a long call streamed token by
    token costs its length once, not once per token. Brackets inside strings do not count."""

    __slots__ = ("start", "pos", "depth", "in_string", "escaped", "end")

    def __init__(self) -> None:
        self.start = -1

    def find(self, text: str, start: int) -> int:
        """The index just past the object; -1 while it is not closed."""
        if start != self.start:
            self.start, self.pos, self.depth, self.in_string, self.escaped, self.end = start, start, 0, False, False, -1
        if self.end >= 0:
            return self.end
        depth, in_string, escaped = self.depth, self.in_string, self.escaped
        for i in range(self.pos, len(text)):
            char = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    self.end = i + 1
                    return self.end
        self.pos, self.depth, self.in_string, self.escaped = len(text), depth, in_string, escaped
        return -1


def json_object_end(text: str, start: int) -> int:
    """``ObjectEnd().find(text, start)``, for one-off use."""
    return ObjectEnd().find(text, start)


def read_call(source: str, tool_names: frozenset[str], argument_keys: tuple[str, ...]) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of a call object's JSON text, or None when it is not a valid call
    of one of ``tool_names`` (arguments under the first of ``argument_keys`` present; absent: {})."""
    try:
        value = json.loads(source)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in tool_names:
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in value:
            arguments = value[key]
            break
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], arguments


def arguments_text(arguments: Any) -> str:
    """A call's arguments as JSON text: an object is encoded, a string (already JSON) kept."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


@dataclass(frozen=True)
class CallPrefix:
    """How far a call written name first (``<opener>{"name": "NAME", "<key>": {...``) has got."""

    name: str  # as far as it is written
    name_done: bool  # its closing quote is written
    arguments_start: int  # the index of the arguments object's "{"; -1 before it is written


def read_call_prefix(text: str, opener: str, argument_keys: tuple[str, ...]) -> CallPrefix | None:
    """The prefix of the call at the start of ``text`` (which starts with ``opener``), or None when
    it is not written name first (another key order, or not a call's form)."""
    reader = _Reader(text, len(opener))
    if not reader.literal("{") or not reader.literal('"name"') or not reader.literal(":") \
            or not reader.literal('"'):
        return None if reader.mismatch else CallPrefix("", False, -1)
    close = text.find('"', reader.at)
    if close < 0:
        name = text[reader.at:]
        return None if "\\" in name else CallPrefix(name, False, -1)
    name = text[reader.at:close]
    if "\\" in name:  # tool names have no escapes
        return None
    reader.at = close + 1
    if not reader.literal(",") or not reader.literal('"') or not reader.one_of(argument_keys) \
            or not reader.literal('"') or not reader.literal(":"):
        return CallPrefix(name, True, -1)
    reader.skip_space()
    return CallPrefix(name, True, reader.at if text.startswith("{", reader.at) else -1)


class _Reader:
    """Reads literals (whitespace before each) from a text that may end anywhere: ``mismatch``
    tells a text that goes on otherwise from one that ends inside the literal."""

    __slots__ = ("text", "at", "mismatch")

    def __init__(self, text: str, at: int) -> None:
        self.text, self.at, self.mismatch = text, at, False

    def skip_space(self) -> None:
        while self.at < len(self.text) and self.text[self.at] in " \t\r\n":
            self.at += 1

    def literal(self, expected: str) -> bool:
        self.skip_space()
        written = self.text[self.at:self.at + len(expected)]
        if written == expected:
            self.at += len(expected)
            return True
        self.mismatch = not expected.startswith(written)
        return False

    def one_of(self, words: tuple[str, ...]) -> bool:
        for word in words:
            if self.text.startswith(word, self.at):
                self.at += len(word)
                return True
        return False


def partial_suffix(text: str, opener: str) -> int:
    """Index from which ``text`` ends with a proper prefix of ``opener`` (len: it does not)."""
    for size in range(min(len(opener) - 1, len(text)), 0, -1):
        if text.endswith(opener[:size]):
            return len(text) - size
    return len(text)
