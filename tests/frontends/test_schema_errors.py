"""llguidance's reasons for refusing a JSON schema, said in the terms of the user's schema: the
feature, where it is, what to do instead (the reasons are llguidance's own, produced here)."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from api.schema_errors import describe_unsupported


def reason(schema: dict) -> str:
    return LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(json.dumps(schema)))


@pytest.mark.parametrize("schema, path, words", [
    ({"properties": {"not": {"anyOf": [{"type": "string"}, {"not": {"type": "string"}}]}}},
     "properties.not.anyOf[1].not", ['keyword "not" is not supported']),  # a property named "not" is no keyword
    ({"properties": {"a": {"type": "array", "uniqueItems": True, "contains": {}}}},
     "properties.a", ['keywords "contains", "uniqueItems" are not supported', "remove them"]),
    ({"$defs": {"when": {"type": "string", "format": "bogus"}}, "properties": {"w": {"$ref": "#/$defs/when"}}},
     "$defs.when.format", ['"format": "bogus"']),
    ({"properties": {"r": {"$ref": "https://example.com/r.json"}}}, "properties.r.$ref",
     ['"$ref": "https://example.com/r.json" points outside the schema', '"$defs"']),
    ({"properties": {"p": {"type": "string", "pattern": "a(?<=a)"}}}, "properties.p.pattern",
     ['"pattern" is not supported as written (look-around']),
])
def test_unsupported_features_are_named_where_they_are(schema, path, words):
    problem = describe_unsupported({"type": "object", **schema}, reason({"type": "object", **schema}))
    assert problem.path == path
    assert all(word in problem.message for word in words), problem.message


def test_an_unknown_reason_is_its_first_line():
    problem = describe_unsupported({}, "something new\n  | grammar text")
    assert (problem.message, problem.path) == ("something new", "")
