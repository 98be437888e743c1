"""Tool calling, whatever the API: the request's tools and tool choice as one ``ToolPolicy``.

The OpenAI and Anthropic handlers translate their bodies into a
``ToolPolicy`` (``api.openai_tools``, ``api.anthropic_tools``);
from there everything is shared:

- ``auto``: free-form generation; the model's text is parsed into calls by
  the model's call format (``api.tool_parsers``).
- ``required`` (OpenAI) / ``any`` (Anthropic), and a named tool: enforced by
  constrained decoding. The grammar is the model's own call format with each
  allowed tool's JSON schema embedded (llguidance Lark, ``%json{...}``), one
  call or a list of calls when parallel calls are allowed, so even a
  random-weight model answers with a well-formed call whose arguments
  validate against the schema.
- ``none``: tools stay in the prompt (as the APIs specify); nothing is parsed.

Schemas are checked by llguidance, the engine's grammar compiler: malformed
(every mode) or unsupported by the grammar engine (forced modes) is a 400
that names the tool's field. Checks and grammars are cached per schema text.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher

from api.errors import InvalidRequestError
from api.schema_errors import describe_unsupported
from api.tool_parsers import CallSyntax, ToolCallParser
from workers.sampling_params import GuidedDecoding

__all__ = ["ToolSpec", "ToolPolicy", "check_tool_schemas", "tool_spec", "check_named_tool",
           "AUTO", "NONE", "REQUIRED", "NAMED"]

logger = logging.getLogger(__name__)

AUTO, NONE, REQUIRED, NAMED = "auto", "none", "required", "named"
# What the APIs allow (OpenAI: [a-zA-Z0-9_-]{1,64}), and MCP-style dots and colons: no quotes or
# spaces, so a name is safe in a grammar and in a call's text.
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_EMPTY_OBJECT = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: dict[str, Any]  # the arguments' JSON schema
    param: str  # the request field of the schema (for errors): "tools[2].function.parameters"
    name_param: str  # and of the name: "tools[2].function.name"


@dataclass(frozen=True)
class ToolPolicy:
    tools: tuple[ToolSpec, ...] = ()
    mode: str = NONE  # AUTO | NONE | REQUIRED | NAMED
    name: str | None = None  # the tool that NAMED forces
    parallel: bool = True  # more than one call per answer
    choice_param: str = "tool_choice"

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.mode != NONE

    @property
    def is_forced(self) -> bool:
        return self.mode in (REQUIRED, NAMED)

    def parser(self, syntax: CallSyntax | None, streaming: bool = False) -> ToolCallParser | None:
        """The output parser of this request, or None when its output is plain text. A streamed
        forced call streams its arguments as they come: its grammar guarantees its form."""
        if syntax is None or not self.parses_calls:
            return None
        return ToolCallParser(syntax, (tool.name for tool in self.tools), forced=self.is_forced, streaming=streaming)

    def guided(self, syntax: CallSyntax | None) -> GuidedDecoding | None:
        """The grammar that enforces a forced choice (None for auto and none)."""
        if not self.is_forced:
            return None
        if syntax is None:
            raise InvalidRequestError(
                "this model has no known tool-call format, so tool calls cannot be forced; start the server "
                "with --tool-call-parser", param=self.choice_param)
        allowed = [t for t in self.tools if self.mode == REQUIRED or t.name == self.name]
        for tool in allowed:
            _check_enforceable(tool)
        parallel = self.parallel and self.mode == REQUIRED
        tools_json = json.dumps([(t.name, t.parameters) for t in allowed], sort_keys=True)
        grammar, error = _forced_grammar(syntax.name, tools_json, parallel)
        if error:  # each schema compiles alone: not the user's to fix, but say what failed
            logger.warning("the forced-call grammar of tools %s does not compile: %s",
                           [t.name for t in allowed], error)
            raise InvalidRequestError("these tools' schemas cannot be enforced together for a forced tool call; "
                                      "use tool_choice auto", param=self.choice_param)
        return GuidedDecoding("lark", grammar)


def check_tool_schemas(tools: list[ToolSpec]) -> None:
    """400 naming the field of the first malformed schema or duplicate name."""
    seen: set[str] = set()
    for tool in tools:
        name_param = tool.name_param
        if not _NAME.fullmatch(tool.name):
            raise InvalidRequestError(f"a tool's name must match {_NAME.pattern} (letters, digits, _ . : -), got "
                                      f"{tool.name!r}", param=name_param)
        if tool.name in seen:
            raise InvalidRequestError(f"two tools are named {tool.name!r}", param=name_param)
        seen.add(tool.name)
        if tool.parameters.get("type", "object") != "object":
            raise InvalidRequestError(f"a tool's schema must describe an object, got type "
                                      f"{tool.parameters.get('type')!r}", param=tool.param)
        error = _schema_error(json.dumps(tool.parameters, sort_keys=True))
        if error:
            raise _schema_problem(tool, error, f"invalid JSON schema for tool {tool.name!r}")


def tool_spec(name: str, schema: dict[str, Any] | None, param: str, name_param: str) -> ToolSpec:
    """A tool; no schema (or an empty one) means any arguments object."""
    return ToolSpec(name, schema if schema else dict(_EMPTY_OBJECT), param, name_param)


def check_named_tool(tools: tuple[ToolSpec, ...], name: str, param: str) -> None:
    if name not in {t.name for t in tools}:
        raise InvalidRequestError(f"tool_choice names the tool {name!r}, which is not in tools", param=param)


def _check_enforceable(tool: ToolSpec) -> None:
    """400 naming what in the tool's schema a forced call cannot enforce, where, and what to do."""
    error = _strict_schema_error(json.dumps(tool.parameters, sort_keys=True))
    if error:
        raise _schema_problem(tool, error, f"the schema of tool {tool.name!r} cannot be enforced for a forced call",
                              "; or let the model choose (tool_choice auto), which does not enforce the schema")


def _schema_problem(tool: ToolSpec, error: str, what: str, advice: str = "") -> InvalidRequestError:
    """The 400 of a schema llguidance refused (``error``), in the terms of the user's schema."""
    problem = describe_unsupported(tool.parameters, error)
    where = f" (at {problem.path})" if problem.path else ""
    return InvalidRequestError(f"{what}{where}: {problem.message}{advice}",
                               param=f"{tool.param}.{problem.path}" if problem.path else tool.param)


@functools.lru_cache(maxsize=1024)
def _strict_schema_error(schema_json: str) -> str:
    # not lenient: a forced call enforces every keyword, so one the grammar engine lacks is an error.
    return LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema_json))


@functools.lru_cache(maxsize=1024)
def _schema_error(schema_json: str) -> str:
    # lenient: keywords the grammar engine does not implement are no error for a free-form (auto) request.
    grammar = LLMatcher.grammar_from_json_schema(schema_json, overrides={"lenient": True})
    return LLMatcher.validate_grammar(grammar)


@functools.lru_cache(maxsize=1024)
def _forced_grammar(syntax_name: str, tools_json: str, parallel: bool) -> tuple[str, str]:
    from api.tool_parsers import tool_syntax

    tools = [(name, schema) for name, schema in json.loads(tools_json)]
    lark = tool_syntax(syntax_name).grammar(tools, parallel)
    return lark, LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(lark))

