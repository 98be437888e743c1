"""Structured-output and sampling-control inputs that cannot be honoured get a 400 that
names the field (and, for a schema, what is unsupported), never a silent 200."""

from __future__ import annotations

import pytest
from test_http_errors import anthropic_error, openai_error

pytestmark = pytest.mark.asyncio

USER = [{"role": "user", "content": "Hello"}]
CHAT = {"model": "tiny-test", "messages": USER, "max_tokens": 4}
COMPLETION = {"model": "tiny-test", "prompt": "Hello", "max_tokens": 4}
ANTHROPIC = {"model": "tiny-test", "messages": USER, "max_tokens": 4}
NOT_SUPPORTED = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("path, base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("response_format, words", [
    ({"type": "nonsense"}, ["nonsense", "response_format"]),
    ({"type": "json_schema"}, ["json_schema", "response_format"]),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, ["name", "response_format"]),
    (_json_schema(NOT_SUPPORTED), ['response_format cannot be enforced: the keyword "not" is not supported',
                                   "(at properties.a.not)"]),
    (_json_schema({"type": "string", "format": "bogus"}), ['"format": "bogus" is not a known format', "(at format)"]),
    (_json_schema({"type": "integer", "minimum": 5, "maximum": 2}), ["minimum (5) is greater than maximum (2)"]),
])
async def test_response_format_that_cannot_be_enforced(harness, path, base, response_format, words):
    error = openai_error(await harness.http.post(path, json={**base, "response_format": response_format}), 400)
    assert error["param"].startswith("response_format")
    assert all(word in error["message"] for word in words), error["message"]


@pytest.mark.parametrize("response_format", [{"type": "text"}, {"type": "json_object"},
                                             _json_schema({"type": "object"})])
async def test_response_formats_that_compile_are_accepted(harness, response_format):
    response = await harness.http.post("/v1/chat/completions", json={**CHAT, "response_format": response_format})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("output_config, words", [
    ({"format": {"type": "nonsense", "schema": {}}}, ["nonsense", "output_config.format"]),
    ({"format": {"type": "json_schema"}}, ["schema", "output_config.format"]),
    ({"format": {"type": "json_schema", "schema": NOT_SUPPORTED}}, ["not", "output_config.format cannot be enforced"]),
])
async def test_anthropic_output_format_that_cannot_be_enforced(harness, output_config, words):
    error = anthropic_error(await harness.http.post("/v1/messages", json={**ANTHROPIC, "output_config": output_config}),
                            400)
    assert error["type"] == "invalid_request_error"
    assert all(word in error["message"] for word in words), error["message"]


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("presence_penalty", -3), ("frequency_penalty", 2.01), ("frequency_penalty", -9),
    ("repetition_penalty", 0), ("repetition_penalty", 2.5), ("min_p", 1.5), ("min_p", -0.1),
])
@pytest.mark.parametrize("path, base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
async def test_out_of_range_sampling_controls(harness, path, base, field, value):
    error = openai_error(await harness.http.post(path, json={**base, field: value}), 400)
    assert error["param"] == field and field in error["message"]


@pytest.mark.parametrize("logit_bias", [{"abc": 1}, {"-1": 1}, {"512": 1}, {"1.5": 1}, {"7": "high"}])
async def test_logit_bias_with_bad_token_ids_or_values(harness, logit_bias):
    error = openai_error(await harness.http.post("/v1/chat/completions", json={**CHAT, "logit_bias": logit_bias}), 400)
    assert error["param"].startswith("logit_bias")


async def test_logit_bias_values_are_clamped_like_openai(harness):
    response = await harness.http.post("/v1/chat/completions",
                                       json={**CHAT, "logit_bias": {"7": 250, "8": -1e6}, "presence_penalty": 1.0,
                                             "frequency_penalty": -1.0, "repetition_penalty": 1.2, "min_p": 0.1})
    assert response.status_code == 200, response.text


async def test_logit_bias_pairs_are_sorted_ids_with_clamped_values():
    from api.structured import logit_bias_pairs

    assert logit_bias_pairs({"7": 250, "3": -1e6, "5": 0.5}, 512) == ((3, -100.0), (5, 0.5), (7, 100.0))


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"regex": "[a-z]+("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": NOT_SUPPORTED}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(?=x)"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
])
async def test_vllm_structured_outputs_that_cannot_be_enforced(harness, extra, param):
    error = openai_error(await harness.http.post("/v1/completions", json={**COMPLETION, **extra}), 400)
    assert error["param"] == param and param in error["message"], error


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"regex": "[a-z]{3}"}}, {"structured_outputs": {"choice": ["yes", 'no "quoted"']}},
    {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, {"structured_outputs": {"json_object": True}},
    {"guided_json": {"type": "object"}}, {"guided_grammar": 'start: "x"+'},
])
async def test_vllm_structured_outputs_that_compile_are_accepted(harness, extra):
    response = await harness.http.post("/v1/chat/completions", json={**CHAT, **extra})
    assert response.status_code == 200, response.text
