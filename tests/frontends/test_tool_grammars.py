"""Forced tool calls: the grammars walked token by token with llguidance over the tiny model's tokenizer.

A valid call in the model's format is accepted to the end (and parses back
into the same call); a call that breaks the schema, names another tool or
writes the format differently is refused at some token.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from llguidance import LLMatcher, LLTokenizer

from api.errors import InvalidRequestError
from api.tool_calls import AUTO, NAMED, REQUIRED, ToolPolicy, check_tool_schemas, tool_spec
from api.tool_parsers import ParsedCall, ToolCallParser, tool_syntax

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days"],
}
TIME = {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}
TOOLS = (tool_spec("get_weather", WEATHER, "tools[0].function.parameters", "tools[0].function.name"),
         tool_spec("get_time", TIME, "tools[1].function.parameters", "tools[1].function.name"))

CALLS = {
    "hermes": ('<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>', "\n"),
    "llama3_json": ('{{"name": "{name}", "parameters": {args}}}', "; "),
}


@pytest.fixture(scope="module")
def lltokenizer(tiny_model_dir) -> LLTokenizer:
    return LLTokenizer((tiny_model_dir / "tokenizer.json").read_text())


def call_text(fmt: str, *calls: tuple[str, dict]) -> str:
    template, separator = CALLS[fmt]
    return separator.join(template.format(name=name, args=json.dumps(args)) for name, args in calls)


def accepts(lltokenizer: LLTokenizer, policy: ToolPolicy, fmt: str, text: str) -> bool:
    guided = policy.guided(tool_syntax(fmt))
    assert guided is not None and guided.kind == "lark"
    matcher = LLMatcher(lltokenizer, LLMatcher.grammar_from_lark(guided.spec))
    assert not matcher.is_error(), matcher.get_error()
    tokens = lltokenizer.tokenize_str(text)
    return matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens) \
        and matcher.is_accepting()


@pytest.mark.parametrize("fmt", sorted(CALLS))
def test_named_tool_accepts_a_valid_call_and_it_parses_back(lltokenizer, fmt):
    policy = ToolPolicy(TOOLS, NAMED, name="get_weather")
    arguments = {"city": "Paris", "days": 3, "unit": "celsius"}
    text = call_text(fmt, ("get_weather", arguments))
    assert accepts(lltokenizer, policy, fmt, text)
    jsonschema.validate(arguments, WEATHER)
    parser = ToolCallParser(tool_syntax(fmt), ["get_weather", "get_time"])
    assert parser.feed(text) + parser.finish() == [ParsedCall(0, "get_weather", arguments)]


@pytest.mark.parametrize("fmt", sorted(CALLS))
@pytest.mark.parametrize("bad", [
    ("get_weather", {"city": "Paris", "days": 9}),  # out of range
    ("get_weather", {"city": "Paris"}),  # a required argument missing
    ("get_weather", {"city": "Paris", "days": 2, "unit": "kelvin"}),  # not in the enum
    ("get_weather", {"city": "Paris", "days": 2, "extra": 1}),  # an argument the schema does not allow
    ("get_time", {"tz": "UTC"}),  # another tool than the named one
])
def test_named_tool_refuses_invalid_calls(lltokenizer, fmt, bad):
    schema = {**WEATHER, "additionalProperties": False}
    policy = ToolPolicy((tool_spec("get_weather", schema, "p", "n"), TOOLS[1]), NAMED, name="get_weather")
    assert not accepts(lltokenizer, policy, fmt, call_text(fmt, bad))


@pytest.mark.parametrize("fmt", sorted(CALLS))
def test_required_allows_any_tool_and_parallel_calls_only_when_asked(lltokenizer, fmt):
    two = call_text(fmt, ("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Oslo", "days": 1}))
    assert accepts(lltokenizer, ToolPolicy(TOOLS, REQUIRED, parallel=True), fmt, two)
    assert not accepts(lltokenizer, ToolPolicy(TOOLS, REQUIRED, parallel=False), fmt, two)
    assert accepts(lltokenizer, ToolPolicy(TOOLS, REQUIRED, parallel=False), fmt,
                   call_text(fmt, ("get_time", {"tz": "UTC"})))
    parser = ToolCallParser(tool_syntax(fmt), ["get_weather", "get_time"])
    assert [e.name for e in parser.feed(two) + parser.finish()] == ["get_time", "get_weather"]


@pytest.mark.parametrize("fmt", sorted(CALLS))
def test_free_text_and_free_whitespace_are_refused(lltokenizer, fmt):
    policy = ToolPolicy(TOOLS, REQUIRED)
    assert not accepts(lltokenizer, policy, fmt, "Sure! " + call_text(fmt, ("get_time", {"tz": "UTC"})))
    spaced = call_text(fmt, ("get_time", {"tz": "UTC"})).replace('"tz": ', '"tz":    ')
    assert not accepts(lltokenizer, policy, fmt, spaced)


def test_auto_and_none_have_no_grammar():
    assert ToolPolicy(TOOLS, AUTO).guided(tool_syntax("hermes")) is None
    assert ToolPolicy().guided(None) is None


def test_forced_without_a_call_format_is_a_400():
    with pytest.raises(InvalidRequestError) as info:
        ToolPolicy(TOOLS, REQUIRED).guided(None)
    assert info.value.param == "tool_choice"


@pytest.mark.parametrize("schema, message", [
    ({"type": "object", "properties": {"a": {"type": "nonsense"}}}, "Invalid type"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}, "minimum"),
    ({"type": "object", "required": "a"}, "required"),
    ({"type": "array"}, "must describe an object"),
])
def test_malformed_schemas_name_the_field(schema, message):
    tools = [tool_spec("ok", TIME, "tools[0].function.parameters", "tools[0].function.name"),
             tool_spec("bad", schema, "tools[1].function.parameters", "tools[1].function.name")]
    with pytest.raises(InvalidRequestError, match=message) as info:
        check_tool_schemas(tools)
    assert info.value.param == "tools[1].function.parameters"


def test_duplicate_tool_names_are_a_400():
    with pytest.raises(InvalidRequestError, match="two tools") as info:
        check_tool_schemas([tool_spec("a", None, "tools[0].input_schema", "tools[0].name"),
                            tool_spec("a", None, "tools[1].input_schema", "tools[1].name")])
    assert info.value.param == "tools[1].name"
