"""Structured outputs and sampling controls, from API bodies to ``SamplingParams`` fields.

OpenAI ``response_format``: ``text`` (free), ``json_object`` (any JSON object,
schema ``{"type": "object"}``), ``json_schema`` (``json_schema.schema``; ``strict``
is accepted and changes nothing: the grammar is always enforced). Anthropic
``output_config.format``: ``{"type": "json_schema", "schema": {...}}``. Any other
type is a 400 naming the field (the body's tagged union refuses it at decode).

Every grammar is compiled here too, against this frontend's tokenizer, before
the request reaches the engine: a schema llguidance cannot enforce is a 400
that names the field and what is unsupported (e.g. ``Unimplemented keys:
["not"]``), never a silent free-form answer. Compilation is cached per grammar
(``workers.guided.GrammarCompiler``), and the compiler is built on the first
constrained request, so a frontend that never sees one never pays for it.

vLLM's extensions on both OpenAI endpoints: ``structured_outputs`` (one of
``json``, ``regex``, ``choice``, ``grammar`` (Lark or GBNF), ``json_object``)
and the older top-level ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar``. At most one constraint per request: two are a 400.

``logit_bias`` (OpenAI): token ids as strings, values clamped to [-100, 100] as
OpenAI does; an id that is not an integer or lies outside the vocabulary is a 400.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec
from llguidance.gbnf_to_lark import any_to_lark

from api.errors import InvalidRequestError
from api.request_limits import MAX_CHOICES, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, check_count
from api.schema_errors import describe_unsupported
from api.tokenizer import Tokenizer
from workers.guided import JSON_OBJECT_SCHEMA, GrammarCompiler
from workers.sampling_params import GuidedDecoding

__all__ = [
    "ResponseFormat",
    "OutputConfig",
    "StructuredOutputs",
    "openai_guided",
    "anthropic_guided",
    "logit_bias_pairs",
    "openai_controls",
    "GrammarChecker",
]

_MAX_BIAS = 100.0


class ResponseFormatText(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    pass


class ResponseFormatJsonObject(msgspec.Struct, frozen=True, tag_field="type", tag="json_object"):
    pass


class JsonSchemaSpec(msgspec.Struct, frozen=True):
    name: str
    schema: dict[str, Any] | None = None  # absent: any JSON object
    strict: bool | None = None
    description: str | None = None


class ResponseFormatJsonSchema(msgspec.Struct, frozen=True, tag_field="type", tag="json_schema"):
    json_schema: JsonSchemaSpec


ResponseFormat = ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema


class AnthropicJsonFormat(msgspec.Struct, frozen=True, tag_field="type", tag="json_schema"):
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, frozen=True):
    format: AnthropicJsonFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted; no effect here


class StructuredOutputs(msgspec.Struct, frozen=True):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def openai_guided(body: Any) -> tuple[GuidedDecoding | None, str]:
    """The grammar an OpenAI body (chat or completions) asks for, and the field that asked."""
    found: list[tuple[GuidedDecoding, str]] = []
    response_format = body.response_format
    if response_format is not None and not isinstance(response_format, ResponseFormatText):
        if isinstance(response_format, ResponseFormatJsonObject) or response_format.json_schema.schema is None:
            found.append((GuidedDecoding("json_schema", JSON_OBJECT_SCHEMA), "response_format"))
        else:
            found.append((GuidedDecoding("json_schema", json.dumps(response_format.json_schema.schema)),
                          "response_format"))
    outputs = body.structured_outputs
    vllm = {
        "json": outputs.json if outputs else None, "regex": outputs.regex if outputs else None,
        "choice": outputs.choice if outputs else None, "grammar": outputs.grammar if outputs else None,
        "json_object": outputs.json_object if outputs else None,
    }
    for name, value in vllm.items():
        if value is not None and value is not False:
            found.append((_vllm_guided(name, value, f"structured_outputs.{name}"), f"structured_outputs.{name}"))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{name}")
        if value is not None:
            found.append((_vllm_guided(name, value, f"guided_{name}"), f"guided_{name}"))
    if len(found) > 1:
        raise InvalidRequestError(f"at most one output constraint per request, got {', '.join(p for _, p in found)}",
                                  param=found[1][1])
    return found[0] if found else (None, "response_format")


def _vllm_guided(name: str, value: Any, param: str) -> GuidedDecoding:
    if name == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise InvalidRequestError(f"{param} must be a JSON schema", param=param) from None
        return GuidedDecoding("json_schema", json.dumps(value))
    if name == "json_object":
        return GuidedDecoding("json_schema", JSON_OBJECT_SCHEMA)
    if name == "regex":
        return GuidedDecoding("regex", value)
    if name == "choice":
        if not value:
            raise InvalidRequestError(f"{param} must list at least one choice", param=param)
        check_count(value, MAX_CHOICES, param)
        return GuidedDecoding("lark", "start: " + " | ".join(json.dumps(choice) for choice in value))
    try:  # grammar: Lark, or llama.cpp's GBNF (converted)
        return GuidedDecoding("lark", any_to_lark(value))
    except Exception as exc:  # noqa: BLE001 - the converter raises plain exceptions on syntax errors
        raise InvalidRequestError(f"{param} is neither a Lark nor a GBNF grammar: {exc}", param=param) from None


def anthropic_guided(output_config: OutputConfig | None) -> GuidedDecoding | None:
    if output_config is None or output_config.format is None:
        return None
    return GuidedDecoding("json_schema", json.dumps(output_config.format.schema))


def openai_controls(body: Any, vocab_size: int) -> dict[str, Any]:
    """``ServingContext.sampling_params`` keyword arguments from an OpenAI body's sampling
    controls (the grammar, ``openai_guided``, is passed on its own)."""
    check_count(body.stop_token_ids, MAX_STOP_TOKEN_IDS, "stop_token_ids")
    check_count(body.logit_bias, MAX_LOGIT_BIAS, "logit_bias")
    return {
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "min_p": body.min_p,
        "stream_interval": body.stream_interval,
        "priority": body.priority,
        "logit_bias": logit_bias_pairs(body.logit_bias, vocab_size),
    }


def logit_bias_pairs(logit_bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` as sorted (id, bias) pairs, biases clamped to [-100, 100]."""
    if not logit_bias:
        return ()
    pairs = []
    for key, bias in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})",
                                      param="logit_bias")
        pairs.append((token_id, max(-_MAX_BIAS, min(_MAX_BIAS, float(bias)))))
    return tuple(sorted(pairs))


class GrammarChecker:
    """Whether a grammar compiles for this frontend's tokenizer (a 400 naming ``param`` if not)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None

    def check(self, guided: GuidedDecoding, param: str) -> None:
        if self._compiler is None:
            eos = () if self._tokenizer.eos_token_id is None else (self._tokenizer.eos_token_id,)
            # A synthetic engine may report fewer ids than the tokenizer has: the checks need them all.
            vocab_size = max(self._vocab_size, self._tokenizer.vocab_size)
            self._compiler = GrammarCompiler.for_tokenizer(self._tokenizer.backend, vocab_size, eos)
        error = self._compiler.check(guided)
        if error is None:
            return
        if guided.kind == "json_schema":  # said in the terms of the user's schema
            try:
                problem = describe_unsupported(json.loads(guided.spec), error)
            except ValueError:
                pass
            else:
                error = f"{problem.message} (at {problem.path})" if problem.path else problem.message
        raise InvalidRequestError(f"{param} cannot be enforced: {error}", param=param)
