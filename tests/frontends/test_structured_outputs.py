"""Structured outputs over real HTTP with the random-weight tiny model (torch engine):
20 JSON schemas through the official SDKs on one worker and through a ctx + gen
pair (the test plays the orchestrator), greedy and sampled; every output parses
and validates. Free requests next to constrained ones keep their tokens.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import jsonschema
import openai
import pytest
from json_schemas import SCHEMAS
from test_disagg_worker import ctx_leg, gen_body, post

from tests.worker_process import start_worker, stop_worker, worker_log

MODEL = "tiny-test"
MAX_TOKENS = 200
SAMPLINGS = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 1.0, "seed": 11}}


@pytest.fixture(scope="module")
def workers(tiny_model_dir, tmp_path_factory):
    """(ctx url, gen url) of torch-engine workers; the ctx worker also serves plain requests."""
    key_file = tmp_path_factory.mktemp("key") / "cluster.key"
    key_file.write_text(os.urandom(32).hex())
    key_file.chmod(0o600)
    common = ["--cluster-key-file", str(key_file), "--block-size", "4"]
    ctx_url, ctx_proc = start_worker(tiny_model_dir, 1, "torch", extra_args=["--role", "ctx", *common], timeout=120)
    try:
        gen_url, gen_proc = start_worker(tiny_model_dir, 1, "torch", extra_args=["--role", "gen", *common],
                                         timeout=120)
    except BaseException:
        stop_worker(ctx_proc)
        raise
    yield ctx_url, gen_url
    for proc in (ctx_proc, gen_proc):
        assert stop_worker(proc) == 0, worker_log(proc)


def chat_body(i: int, schema: dict, sampling: dict) -> dict:
    return {"model": MODEL, "max_tokens": MAX_TOKENS, **sampling,
            "messages": [{"role": "user", "content": f"Answer in JSON, case {i}."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                        "strict": True}}}


def assert_valid(text: str, finish_reason: str, schema: dict) -> None:
    assert finish_reason == "stop", text
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_twenty_schemas_on_one_worker_with_the_openai_sdk(workers, sampling):
    client = openai.OpenAI(base_url=f"{workers[0]}/v1", api_key="unused")

    def ask(item):
        i, schema = item
        body = chat_body(i, schema, SAMPLINGS[sampling])
        response = client.chat.completions.create(**{k: v for k, v in body.items() if k != "model"}, model=MODEL)
        return response.choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(ask, enumerate(SCHEMAS)))
    for choice, schema in zip(choices, SCHEMAS):
        assert_valid(choice.message.content, choice.finish_reason, schema)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_twenty_schemas_disaggregated(workers, sampling):
    ctx_url, gen_url = workers

    def ask(item):
        i, schema = item
        body = chat_body(i, schema, SAMPLINGS[sampling])
        status, answer = post(gen_url, "/v1/chat/completions", gen_body(body, ctx_leg(ctx_url, "/v1/chat/completions",
                                                                                      body)))
        assert status == 200, answer
        return answer["choices"][0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(ask, enumerate(SCHEMAS)))
    for choice, schema in zip(choices, SCHEMAS):
        assert_valid(choice["message"]["content"], choice["finish_reason"], schema)


def test_disaggregated_greedy_equals_aggregated_and_streams(workers):
    ctx_url, gen_url = workers
    body = {**chat_body(0, SCHEMAS[10], SAMPLINGS["greedy"]), "stream": True}
    status, reference = post(ctx_url, "/v1/chat/completions", {**body, "stream": False})
    assert status == 200, reference
    status, events = post(gen_url, "/v1/chat/completions", gen_body(body, ctx_leg(ctx_url, "/v1/chat/completions",
                                                                                  body)))
    assert status == 200, events
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    assert text == reference["choices"][0]["message"]["content"]
    assert_valid(text, reference["choices"][0]["finish_reason"], SCHEMAS[10])


def test_json_object_and_completions_response_format(workers, tokenizer):
    client = openai.OpenAI(base_url=f"{workers[0]}/v1", api_key="unused")
    # Any object: a random model never closes a free-form key, so the bias steers it to the
    # empty object (away from '{"', towards "}"), within what the grammar allows: "}" cannot come first.
    bias = {str(tokenizer.encode(text, add_special_tokens=False)[0]): value
            for text, value in (('{"', -100), ('"', -100), ("}", 100))}
    chat = client.chat.completions.create(model=MODEL, max_tokens=MAX_TOKENS, temperature=0,
                                          messages=[{"role": "user", "content": "JSON please"}],
                                          response_format={"type": "json_object"}, logit_bias=bias)
    assert chat.choices[0].message.content == "{}" and chat.choices[0].finish_reason == "stop"
    completion = client.completions.create(model=MODEL, prompt="A JSON list:", max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                               "name": "list", "schema": SCHEMAS[8]}}})
    assert_valid(completion.choices[0].text, completion.choices[0].finish_reason, SCHEMAS[8])


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_output_config_format(workers, stream):
    client = anthropic.Anthropic(base_url=workers[0], api_key="unused")
    kwargs = dict(model=MODEL, max_tokens=MAX_TOKENS, extra_body={"temperature": 0.0},
                  messages=[{"role": "user", "content": "Who is it?"}],
                  output_config={"format": {"type": "json_schema", "schema": SCHEMAS[18]}})
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), SCHEMAS[18])


def test_free_requests_next_to_constrained_ones_keep_their_tokens(workers):
    url = workers[0]
    free = [{"model": MODEL, "prompt": f"free request number {i}", "max_tokens": 12, "temperature": 0,
             "ignore_eos": True} for i in range(4)]
    alone = [post(url, "/v1/completions", body)[1]["choices"][0]["text"] for body in free]
    constrained = [chat_body(i, schema, SAMPLINGS["greedy"]) for i, schema in enumerate(SCHEMAS[:8])]
    calls = [("/v1/completions", b) for b in free] + [("/v1/chat/completions", b) for b in constrained]
    with ThreadPoolExecutor(len(calls)) as pool:
        answers = list(pool.map(lambda call: post(url, *call), calls))
    assert [a[1]["choices"][0]["text"] for a in answers[:4]] == alone
    for (_, answer), schema in zip(answers[4:], SCHEMAS[:8]):
        assert_valid(answer["choices"][0]["message"]["content"], answer["choices"][0]["finish_reason"], schema)


def test_logit_bias_and_penalties_reach_the_engine(workers):
    url = workers[0]
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    biased = httpx.post(f"{url}/v1/completions", json={**body, "logit_bias": {"77": 100}, "logprobs": 1},
                        timeout=60).json()["choices"][0]
    assert len(set(biased["logprobs"]["tokens"])) == 1 and biased["text"] != plain  # token 77, every time
    looping = httpx.post(f"{url}/v1/completions", json={**body, "frequency_penalty": -2.0, "logprobs": 0},
                         timeout=60).json()["choices"][0]["logprobs"]["tokens"]
    spread = httpx.post(f"{url}/v1/completions", json={**body, "frequency_penalty": 2.0, "logprobs": 0},
                        timeout=60).json()["choices"][0]["logprobs"]["tokens"]
    assert len(set(looping)) < len(set(spread))


@pytest.mark.parametrize("constraint, check", [
    ({"structured_outputs": {"choice": ["alpha", "beta", 'say "hi"']}}, lambda t: t in ("alpha", "beta", 'say "hi"')),
    ({"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2,4}"}}, lambda t: re.fullmatch("[A-Z]{3}-[0-9]{2,4}", t)),
    ({"structured_outputs": {"grammar": 'root ::= "yes" | "no" | "maybe " [0-9]'}},
     lambda t: re.fullmatch("yes|no|maybe [0-9]", t)),
    ({"guided_json": SCHEMAS[6]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[6]) is None),
])
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_vllm_structured_outputs(workers, constraint, check, sampling):
    body = {"model": MODEL, "prompt": "Answer:", "max_tokens": 64, **SAMPLINGS[sampling], **constraint}
    status, answer = post(workers[0], "/v1/completions", body)
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["text"]), choice["text"]


def test_a_grammar_complete_after_the_first_token_finishes_on_the_ctx_leg(workers):
    body = {"model": MODEL, "prompt": "One letter:", "max_tokens": 8, "temperature": 0,
            "structured_outputs": {"regex": "[a-z]"}}
    answer = ctx_leg(workers[0], "/v1/completions", body)
    assert answer["disaggregated_params"]["finished"] and answer["choices"][0]["finish_reason"] == "stop"
    assert re.fullmatch("[a-z]", answer["choices"][0]["text"])
