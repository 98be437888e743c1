"""Guided decoding through EngineCore with the random-weight tiny model: every output
valid under its grammar, free rows untouched, preemption and the disaggregated path
keeping outputs valid, grammars that do not compile rejected."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

import jsonschema
import tokenizers
from engine_runs import run, run_disaggregated, tokens
from json_schemas import SCHEMAS, schema_text
from test_engine_equivalence import make_core, mixed_requests

from workers.guided import lark_json
from workers.protocol import EngineRequest
from workers.sampling_params import GuidedDecoding, SamplingParams

MAX_TOKENS = 200


@pytest.fixture(scope="module")
def decode(tiny_model_dir):
    backend = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    return lambda token_ids: backend.decode(token_ids, skip_special_tokens=True)


def schema_request(request_id: int, schema: dict, **params) -> EngineRequest:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", MAX_TOKENS)
    guided = GuidedDecoding("json_schema", schema_text(schema))
    prompt = [(13 * request_id + 7 * k) % 500 + 5 for k in range(5 + request_id % 7)]
    return EngineRequest(request_id, prompt, SamplingParams(guided=guided, **params))


def assert_valid(outputs, decode, schemas: dict[int, dict]) -> None:
    for request_id, schema in schemas.items():
        text = decode(tokens(outputs[request_id]))
        assert outputs[request_id][-1].finish_reason == "stop", (request_id, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7},
                                      {"temperature": 0.9, "top_p": 0.9}])
def test_every_output_validates_against_its_schema(tiny_model_dir, decode, sampling):
    core = make_core(tiny_model_dir, num_blocks=1024)
    outputs = run(core, *[schema_request(i, s, **sampling) for i, s in enumerate(SCHEMAS)])
    assert_valid(outputs, decode, dict(enumerate(SCHEMAS)))
    assert all(r.grammar is None for r in core.scheduler.requests.values())  # matchers freed


def test_free_rows_in_a_mixed_batch_get_their_tokens_alone(tiny_model_dir, decode):
    free = mixed_requests(6) + [EngineRequest(50 + r.request_id, r.prompt_token_ids,
                                              SamplingParams(max_tokens=8, temperature=1.0, seed=r.request_id))
                                for r in mixed_requests(3)]
    alone = {r.request_id: tokens(run(make_core(tiny_model_dir), r)[r.request_id]) for r in free}
    constrained = [schema_request(100 + i, s) for i, s in enumerate(SCHEMAS[:6])]
    together = run(make_core(tiny_model_dir, num_blocks=1024), *free, *constrained)
    assert {r.request_id: tokens(together[r.request_id]) for r in free} == alone
    assert_valid(together, decode, {100 + i: s for i, s in enumerate(SCHEMAS[:6])})


def test_preemption_by_recompute_keeps_outputs_valid_and_identical(tiny_model_dir, decode):
    requests = [schema_request(i, s) for i, s in enumerate(SCHEMAS[:8])]
    expected = {r.request_id: tokens(run(make_core(tiny_model_dir), r)[r.request_id]) for r in requests}
    core = make_core(tiny_model_dir, num_blocks=24, max_num_batched_tokens=16)
    outputs = run(core, *requests)
    assert core.scheduler.num_preemptions > 0
    assert {i: tokens(o) for i, o in outputs.items()} == expected
    assert_valid(outputs, decode, dict(enumerate(SCHEMAS[:8])))


def test_gen_leg_continues_the_ctx_legs_grammar(tiny_model_dir, decode):
    schema = SCHEMAS[10]
    request = schema_request(0, schema)
    reference = tokens(run(make_core(tiny_model_dir), request)[0])
    first, rest = run_disaggregated(make_core(tiny_model_dir), make_core(tiny_model_dir),
                                    schema_request(0, schema, max_tokens=1), request)
    assert first.new_token_ids == reference[:1]
    assert tokens(rest) == reference[1:]
    jsonschema.validate(json.loads(decode(first.new_token_ids + tokens(rest))), schema)


def test_gen_leg_rejects_a_first_token_its_grammar_refuses(tiny_model_dir):
    gen = make_core(tiny_model_dir)
    not_json = 300  # a word piece: JSON starts with "{"
    gen.add_remote_request(schema_request(0, SCHEMAS[0]), output_token_ids=[not_json])
    (output,) = gen.step()
    assert output.finish_reason == "abort" and "rejects the output token 300" in output.error


@pytest.mark.parametrize("guided, message", [
    (GuidedDecoding("json_schema", '{"not": {"type": "string"}}'), "not"),
    (GuidedDecoding("json_schema", '{"type": "string", "format": "bogus"}'), "Unknown format: bogus"),
    (GuidedDecoding("regex", "[a-z]+("), "unclosed group"),
    (GuidedDecoding("lark", "start: missing_rule"), "missing_rule"),
])
def test_a_grammar_that_does_not_compile_is_rejected_with_the_reason(tiny_model_dir, guided, message):
    core = make_core(tiny_model_dir)
    outputs = run(core, EngineRequest(0, [5, 6, 7], SamplingParams(guided=guided)))
    (output,) = outputs[0]
    assert output.finish_reason == "abort" and "does not compile" in output.error and message in output.error


def test_lark_grammar_with_embedded_json_forces_a_tool_call(tiny_model_dir, decode):
    arguments = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                 "required": ["city", "days"], "additionalProperties": False}
    call_schema = {"type": "object", "properties": {"name": {"const": "weather"}, "arguments": arguments},
                   "required": ["name", "arguments"], "additionalProperties": False}
    grammar = f'start: "<tool_call>" {lark_json(call_schema)} "</tool_call>"'
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, guided=GuidedDecoding("lark", grammar))
    (*_, last) = outputs = run(make_core(tiny_model_dir), EngineRequest(0, [5, 6, 7], params))[0]
    text = decode(tokens(outputs))
    assert last.finish_reason == "stop" and text.startswith("<tool_call>") and text.endswith("</tool_call>")
    call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    assert call["name"] == "weather"
    jsonschema.validate(call["arguments"], arguments)


def test_ignore_eos_still_stops_when_the_grammar_is_complete(tiny_model_dir, decode):
    request = schema_request(0, SCHEMAS[3], ignore_eos=True, min_tokens=50)
    (*_, last) = outputs = run(make_core(tiny_model_dir), request)[0]
    assert last.finish_reason == "stop"
    assert json.loads(decode(tokens(outputs)))["color"] in ("red", "green", "blue")
