"""The object that the start of a JSON object's text holds so far: a cut tool call's arguments.

A call cut by ``max_tokens`` has arguments that are the beginning of a JSON
object. Where an API's answer needs an object (Anthropic's ``tool_use.input``),
it gets what the official SDKs assemble from the same text streamed as
``input_json_delta`` (jiter's ``partial_mode``): every complete value is kept,
an unfinished string, number, ``true``/``false``/``null`` or key is dropped,
and open objects and arrays are closed. So a streamed and a non-streamed
answer hold the same ``input``.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["partial_object"]

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_SPACE = " \t\r\n"


def partial_object(text: str) -> dict[str, Any]:
    """The object the start of ``text`` holds ({} when none: no text, or not an object)."""
    end, closers = _complete_prefix(text)
    if not end:
        return {}
    try:
        value = json.loads(text[:end] + closers)
    except ValueError:  # not the start of JSON after all
        return {}
    return value if isinstance(value, dict) else {}


def _complete_prefix(text: str) -> tuple[int, str]:
    """(end, closers): ``text[:end] + closers`` is the longest complete JSON the text starts with;
    end 0 when there is none. Reads a text that may stop anywhere, or go wrong anywhere."""
    stack: list[str] = []  # the closers of the open objects and arrays, innermost last
    expect_key = False  # in an object, after "{" or ",": the next string is a key
    end, closers = 0, ""
    at, size = 0, len(text)
    while at < size:
        char = text[at]
        if char in _SPACE or char == ":":
            expect_key = expect_key and char != ":"
            at += 1
            continue
        if char == ",":
            expect_key = bool(stack) and stack[-1] == "}"
            at += 1
            continue
        if char in "{[":
            stack.append("}" if char == "{" else "]")
            expect_key = char == "{"
            at += 1
        elif char in "}]":
            if not stack or stack.pop() != char:
                break
            at += 1
        elif char == '"':
            close = _string_end(text, at)
            if close < 0:
                break
            at, was_key, expect_key = close, expect_key, False
            if was_key:
                continue  # a key alone is no value
        elif char in _NUMBER_CHARS:
            token_end = at
            while token_end < size and text[token_end] in _NUMBER_CHARS:
                token_end += 1
            if _NUMBER.fullmatch(text, at, token_end) is None:
                break  # unfinished ("2.", "-", "1e")
            at = token_end
        else:
            literal = next((word for word in _LITERALS if text.startswith(word, at)), None)
            if literal is None:
                break  # unfinished ("tr") or not JSON
            at += len(literal)
        if not stack:  # the top-level value is complete
            return at, ""
        end, closers = at, "".join(reversed(stack))
    return end, closers


def _string_end(text: str, start: int) -> int:
    """The index just past the string that opens at ``text[start] == '"'``; -1 while it is open."""
    at = start + 1
    while True:
        at = text.find('"', at)
        if at < 0:
            return -1
        backslashes = 0
        while text[at - 1 - backslashes] == "\\":
            backslashes += 1
        if backslashes % 2 == 0:
            return at + 1
        at += 1
