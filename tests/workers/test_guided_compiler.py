"""workers.guided: grammars compile once per (kind, spec), copies are independent, the
cache is bounded, and what does not compile says why. Torch-free."""

from __future__ import annotations

import json
import time

import pytest

from workers.guided import GrammarCompiler, GrammarError, lark_json, load_tokenizer
from workers.sampling_params import GuidedDecoding

OBJECT = GuidedDecoding("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                    "required": ["a"], "additionalProperties": False}))


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _compiler(backend, max_cached: int = 256) -> GrammarCompiler:
    compiler = GrammarCompiler.for_tokenizer(backend, 512, [1, 4])
    compiler.max_cached = max_cached
    return compiler


def _feed(matcher, backend, text: str) -> bool:
    return all(matcher.consume_token(t) for t in backend.encode(text, add_special_tokens=False).ids)


def test_matchers_are_independent_copies_of_one_compiled_grammar(backend):
    compiler = _compiler(backend)
    first, second = compiler.matcher(OBJECT), compiler.matcher(OBJECT)
    assert _feed(first, backend, '{"a":1}') and first.is_stopped()
    assert not second.is_stopped() and _feed(second, backend, '{"a":')
    assert not _feed(compiler.matcher(OBJECT), backend, '{"b"')  # the schema, not free JSON
    started = time.perf_counter()
    for _ in range(100):
        compiler.matcher(OBJECT)
    assert (time.perf_counter() - started) / 100 < 1e-3  # cached: a copy, not a compile


def test_the_cache_is_bounded_least_recently_used_first(backend):
    compiler = _compiler(backend, max_cached=2)
    grammars = [GuidedDecoding("regex", f"x{i}") for i in range(3)]
    for guided in grammars:
        compiler.matcher(guided)
    compiler.matcher(grammars[1])  # touched: the oldest is now grammars[2]
    compiler.matcher(GuidedDecoding("regex", "y"))
    assert list(compiler._matchers) == [grammars[1], GuidedDecoding("regex", "y")]


@pytest.mark.parametrize("guided, message", [
    (GuidedDecoding("json_schema", "{not json"), "not valid JSON"),
    (GuidedDecoding("json_schema", "[1]"), "must be an object"),
    (GuidedDecoding("json_schema", '{"type": "object", "properties": {"a": {"not": {}}}}'), "not"),
    (GuidedDecoding("regex", "(?<=a)b"), "look"),
    (GuidedDecoding("lark", 'start: "a" undefined_rule'), "undefined_rule"),
])
def test_what_does_not_compile_says_why(backend, guided, message):
    compiler = _compiler(backend)
    assert message in compiler.check(guided)
    assert compiler.check(guided) == compiler.check(guided)  # cached, errors too
    with pytest.raises(GrammarError, match=message):
        compiler.matcher(guided)


def test_lark_json_embeds_a_schema_without_free_whitespace(backend):
    compiler = _compiler(backend)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    matcher = compiler.matcher(GuidedDecoding("lark", f'start: "<x>" {lark_json(schema)}'))
    assert _feed(matcher, backend, '<x>{"a":')
    assert not _feed(matcher, backend, " ")
