"""Grammars for guided decoding (llguidance), torch-free: the engine's matchers
and the frontends' checks share this one compiler.

A ``GuidedDecoding`` (kind, spec) becomes an llguidance grammar
(``grammar_text``), then a matcher over the model's tokenizer. Compiling a
grammar for a tokenizer is llguidance's ``LLMatcher`` construction (lazy, under
a millisecond for ordinary schemas, measured by benchmarks/structured_output.py);
``GrammarCompiler`` keeps one pristine matcher per distinct (kind, spec) in a
bounded LRU cache and hands out deep copies (about a microsecond each), so a
grammar is compiled once per process however many requests use it.

JSON schemas compile with fixed, compact separators (``,`` and ``:``, no free
whitespace): free whitespace lets a weak model spend its whole budget on
blanks and never close the object. A Lark grammar's embedded ``%json{...}``
does not inherit that: build it with ``lark_json(schema)``, which says so in
the schema's ``x-guidance`` options.

Errors: ``GrammarError`` (a ValueError) names what llguidance refused, e.g.
``Unknown format: bogus`` or an unsupported regex feature.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import llguidance
import tokenizers

from workers.sampling_params import GuidedDecoding

if TYPE_CHECKING:  # a TypedDict of llguidance's stub only: the extension module does not export it
    from llguidance._lib import JsonCompileOptions

__all__ = ["GrammarError", "GrammarCompiler", "grammar_text", "lark_json", "load_tokenizer", "JSON_OBJECT_SCHEMA"]

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # OpenAI json_object: any JSON object
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
_DEFAULT_CACHE_SIZE = 256


class GrammarError(ValueError):
    """The grammar does not compile; the message says what is unsupported or wrong."""


def load_tokenizer(model_dir: str | Path) -> tokenizers.Tokenizer | None:
    """The model's ``tokenizers.Tokenizer``, the one way the engine gets it (None when the
    directory has none): ``tokenizer.json``, or a GGUF file's ``tokenizer.*`` metadata."""
    from workers.engine.model.gguf_metadata import is_gguf_file

    if is_gguf_file(model_dir):
        from workers.engine.model.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(model_dir)[0]
    path = Path(model_dir) / "tokenizer.json"
    return tokenizers.Tokenizer.from_file(str(path)) if path.is_file() else None


def lark_json(schema: dict) -> str:
    """``%json{...}`` for a Lark grammar: ``schema`` with fixed separators, as top-level schemas get."""
    return "%json" + json.dumps({**schema, "x-guidance": {**schema.get("x-guidance", {}), **_JSON_OPTIONS}})


def grammar_text(guided: GuidedDecoding) -> str:
    """The llguidance grammar of ``guided``; GrammarError when the spec is not even parseable."""
    if guided.kind == "json_schema":
        try:
            schema = json.loads(guided.spec)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be an object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(str(exc)) from exc
    if guided.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(guided.spec)
    if guided.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(guided.spec)
    raise GrammarError(f"unknown grammar kind {guided.kind!r}")


class GrammarCompiler:
    """Compiles grammars for one tokenizer; one cached pristine matcher per (kind, spec).

    Not thread-safe: one per process (the engine loop, or a frontend's event loop).
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, max_cached: int = _DEFAULT_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.max_cached = max_cached
        self._matchers: OrderedDict[GuidedDecoding, llguidance.LLMatcher | GrammarError] = OrderedDict()

    @classmethod
    def for_tokenizer(
        cls, backend: tokenizers.Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]
    ) -> GrammarCompiler:
        """``vocab_size`` is the model's (the logits' width), which may exceed the tokenizer's:
        the padding ids are never allowed by a grammar."""
        eos = sorted(eos_token_ids)
        tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos or None)
        return cls(tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def check(self, guided: GuidedDecoding) -> str | None:
        """None when the grammar compiles, else why not (cached like the grammar itself)."""
        compiled = self._compiled(guided)
        return str(compiled) if isinstance(compiled, GrammarError) else None

    def matcher(self, guided: GuidedDecoding) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start; GrammarError when it does not compile."""
        compiled = self._compiled(guided)
        if isinstance(compiled, GrammarError):
            raise compiled
        return compiled.deep_copy()

    def _compiled(self, guided: GuidedDecoding) -> llguidance.LLMatcher | GrammarError:
        compiled = self._matchers.get(guided)
        if compiled is not None:
            self._matchers.move_to_end(guided)
            return compiled
        compiled = self._compile(guided)
        self._matchers[guided] = compiled
        if len(self._matchers) > self.max_cached:
            self._matchers.popitem(last=False)
        return compiled

    def _compile(self, guided: GuidedDecoding) -> llguidance.LLMatcher | GrammarError:
        try:
            grammar = grammar_text(guided)
        except GrammarError as exc:
            return exc
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return GrammarError(matcher.get_error().strip())
        return matcher
