"""n > 1, echo and prefill through the orchestrator's disaggregated flow (a ctx and a gen worker, torch
engine); unknown fields at the orchestrator.

The ctx leg prefills the prompt once and makes choice 0's first token; the gen leg pulls that KV
and makes the n choices, the others hitting the pulled blocks (only the prompt's partial last
block is computed again, on the gen worker). The answers equal the gen worker's own for the
same request, streamed or not.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from disagg_cluster import DisaggCluster, prefill_tokens
from orchestrator_process import start_orchestrator, stop_orchestrator

MODEL = "tiny-test"

LONG = [{"role": "user", "content": " ".join(f"token{i}" for i in range(100))}]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    cluster = DisaggCluster(tmp_path_factory.mktemp("choices"), tiny_model_dir)
    yield cluster
    cluster.close()


def test_chat_n_through_the_disaggregated_flow(cluster):
    direct = openai.OpenAI(base_url=f"{cluster.gen_url}/v1", api_key="unused", max_retries=0, timeout=60)
    ask = {"model": MODEL, "messages": LONG, "max_tokens": 6, "n": 3, "seed": 21, "temperature": 1.0,
           "extra_body": {"ignore_eos": True}}
    alone = direct.chat.completions.create(**ask)
    block_size = httpx.get(cluster.gen_url + "/worker_info").json()["block_size"]
    prefill_tokens(cluster.ctx_url), prefill_tokens(cluster.gen_url)
    raw = cluster.openai().chat.completions.with_raw_response.create(**ask)
    assert raw.headers["x-disagg-mode"] == "disagg"
    answer = raw.parse()
    assert [c.message.content for c in answer.choices] == [c.message.content for c in alone.choices]
    assert answer.usage.prompt_tokens == alone.usage.prompt_tokens and answer.usage.completion_tokens == 18
    prompt = answer.usage.prompt_tokens
    assert prefill_tokens(cluster.ctx_url) == prompt  # once, on the ctx worker
    # choice 0 recomputes nothing on the gen worker; choices 1-2 their last partial block (>= 1 token)
    assert 2 <= prefill_tokens(cluster.gen_url) <= 2 * block_size

    texts = ["", "", ""]
    for chunk in cluster.openai().chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in alone.choices]


def test_completions_n_and_echo_through_the_disaggregated_flow(cluster):
    prompt = " ".join(f"word{i}" for i in range(60))
    ask = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "n": 2, "seed": 4, "echo": True,
           "extra_body": {"ignore_eos": True}}
    direct = openai.OpenAI(base_url=f"{cluster.gen_url}/v1", api_key="unused", max_retries=0, timeout=60)
    alone = direct.completions.create(**ask)
    raw = cluster.openai().completions.with_raw_response.create(**ask)
    assert raw.headers["x-disagg-mode"] == "disagg"
    texts = [c.text for c in raw.parse().choices]
    assert texts == [c.text for c in alone.choices] and all(t.startswith(prompt) for t in texts)


def test_a_choice_that_ends_at_the_ctx_token_still_gets_its_siblings(cluster):
    # The first token is forced (logit_bias) and is a stop token: the ctx leg finishes on it, which alone
    # would be the whole answer for n=1; with n=2 the gen worker serves the request.
    ask = {"model": MODEL, "messages": LONG, "max_tokens": 4, "temperature": 0, "logit_bias": {"7": 100},
           "extra_body": {"stop_token_ids": [7]}}
    raw = cluster.openai().chat.completions.with_raw_response.create(**ask, n=2)
    assert raw.headers["x-disagg-mode"] == "aggregated"
    assert [c.finish_reason for c in raw.parse().choices] == ["stop", "stop"]
    assert cluster.openai().chat.completions.with_raw_response.create(**ask).headers["x-disagg-mode"] == "ctx_only"


PREFILL = [{"role": "user", "content": "Describe the sea."}, {"role": "assistant", "content": "The sea is"}]


def test_prefill_and_unknown_fields_at_the_orchestrator(cluster):
    direct = openai.OpenAI(base_url=f"{cluster.gen_url}/v1", api_key="unused", max_retries=0, timeout=60)
    ask = {"model": MODEL, "messages": PREFILL, "max_tokens": 5, "temperature": 0,
           "extra_body": {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True,
                          "vendor_extra": 1}}
    raw = cluster.openai().chat.completions.with_raw_response.create(**ask)
    assert raw.headers["warning"] == '299 - "unknown fields ignored: vendor_extra"'
    assert raw.parse().choices[0].message.content == direct.chat.completions.create(**ask).choices[0].message.content
    response = cluster.openai().responses.with_raw_response.create(
        model=MODEL, input=PREFILL, max_output_tokens=5, temperature=0, extra_body={"foo": 1})
    assert response.headers["warning"] == '299 - "unknown fields ignored: foo"'
    assert response.parse().output_text == raw.parse().choices[0].message.content


def test_strict_request_fields_at_the_orchestrator(cluster, tmp_path):
    url, orch = start_orchestrator(tmp_path, cluster.model_dir, [("ctx", cluster.ctx_url), ("gen", cluster.gen_url)],
                                   processes=1, strict_request_fields=True)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        for call in (lambda: client.chat.completions.create(model=MODEL, messages=PREFILL[:1], max_tokens=2,
                                                            extra_body={"max_token": 5}),
                     lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                                       extra_body={"max_token": 5}),
                     lambda: client.responses.create(model=MODEL, input="x", max_output_tokens=2,
                                                     extra_body={"max_token": 5})):
            with pytest.raises(openai.BadRequestError) as error:
                call()
            assert error.value.body["param"] == "max_token", error.value.body
        assert client.chat.completions.create(model=MODEL, messages=PREFILL[:1], max_tokens=2).choices
    finally:
        stop_orchestrator(orch)
