"""Why a JSON schema cannot be enforced, in the terms of the user's schema.

llguidance, the grammar compiler, reports what it cannot compile in its own
terms (a keyword list, a regex engine's error, and for a tool the whole Lark
grammar it was embedded in). ``describe_unsupported`` turns that into what the
user wrote and can change: the feature, where it is in the schema (a path
such as ``properties.when.format``), and what to do instead.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["SchemaProblem", "describe_unsupported"]

_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \[([^\]]*)\]')
_REGEX = re.compile(r"regex parse error:.*?\nerror: ([^\n]+)", re.S)
# (llguidance's reason, naming a keyword's value; the keyword; what to tell the user about that value)
_BAD_VALUES = (
    (re.compile(r"Unknown format: (\S+)"), "format",
     '"format": "{}" is not a known format: remove it, or describe the string with a "pattern"'),
    (re.compile(r"Resource '([^']*)' is not present"), "$ref",
     '"$ref": "{}" points outside the schema, and nothing is fetched: put the referenced schema in "$defs" '
     'and refer to it as "#/$defs/..."'),
)
# Keywords whose value maps names (not keywords) to subschemas.
_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("enum", "const", "default", "examples")  # values, not schemas


@dataclass(frozen=True)
class SchemaProblem:
    message: str  # what is unsupported and what to do instead
    path: str  # where in the schema ("" for the schema itself)


def describe_unsupported(schema: dict[str, Any], error: str) -> SchemaProblem:
    """``error``: llguidance's reason for not compiling ``schema``."""
    match = _UNIMPLEMENTED.search(error)
    if match:
        keywords = re.findall(r'"([^"]+)"', match.group(1))
        path = _find(schema, lambda node: any(k in node for k in keywords))
        named = ", ".join(f'"{k}"' for k in keywords)
        several = len(keywords) > 1
        return SchemaProblem(f"the keyword{'s' if several else ''} {named} {'are' if several else 'is'} not "
                             f"supported: remove {'them' if several else 'it'} (state the rule in the description "
                             "instead)", _at(path, "" if several else keywords[0]))
    match = _REGEX.search(error)
    if match:
        path = _find(schema, lambda node: isinstance(node.get("pattern"), str) and node["pattern"] in error)
        return SchemaProblem(f'the "pattern" is not supported as written ({match.group(1).rstrip(".")}): '
                             "rewrite the regular expression without that", _at(path, "pattern"))
    for reason, keyword, message in _BAD_VALUES:
        match = reason.search(error)
        if match:
            value = match.group(1)
            path = _find(schema, functools.partial(_has_value, keyword, value))
            return SchemaProblem(message.format(value), _at(path, keyword))
    return SchemaProblem(error.strip().splitlines()[0] if error.strip() else "unknown reason", "")


def _has_value(keyword: str, value: str, node: dict[str, Any]) -> bool:
    return node.get(keyword) == value


def _find(node: Any, match: Callable[[dict[str, Any]], bool], path: str = "") -> str | None:
    """The path of the first subschema that ``match``es, depth first; None when none does."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            found = _find(item, match, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    if not isinstance(node, dict):
        return None
    if match(node):
        return path
    for key, value in node.items():
        if key in _DATA:
            continue
        if key in _NAMED_SUBSCHEMAS and isinstance(value, dict):
            for name, subschema in value.items():
                found = _find(subschema, match, _join(_join(path, key), name))
                if found is not None:
                    return found
        else:
            found = _find(value, match, _join(path, key))
            if found is not None:
                return found
    return None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path and key else path or key


def _at(path: str | None, key: str) -> str:
    """The path of ``key`` in the subschema at ``path``; "" when the subschema was not found."""
    return "" if path is None else _join(path, key)
