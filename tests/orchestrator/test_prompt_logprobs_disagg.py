"""Prompt logprobs through the orchestrator's disaggregated flow (a ctx and a gen worker, torch engine).

The ctx leg computes them (its engine skips the prefix cache for that request) and returns them in
its ``disaggregated_params``; the gen leg reports them and its engine computes none (it prefills
nothing: the KV is pulled). The answers equal the gen worker's own for the same request.
"""

from __future__ import annotations

import openai
import pytest
from disagg_cluster import DisaggCluster, prefill_tokens

MODEL = "tiny-test"
PROMPT = " ".join(f"word{i}" for i in range(40))


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    cluster = DisaggCluster(tmp_path_factory.mktemp("prompt-logprobs"), tiny_model_dir)
    yield cluster
    cluster.close()


def direct(cluster: DisaggCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.gen_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_echo_logprobs_come_from_the_ctx_leg_once(cluster):
    ask = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 2,
           "extra_body": {"ignore_eos": True, "prompt_logprobs": 1}}
    alone = direct(cluster).completions.create(**ask).choices[0]
    prefill_tokens(cluster.ctx_url), prefill_tokens(cluster.gen_url)
    raw = cluster.openai().completions.with_raw_response.create(**ask)
    assert raw.headers["x-disagg-mode"] == "disagg"
    choice = raw.parse().choices[0]
    prompt_tokens = raw.parse().usage.prompt_tokens
    assert prefill_tokens(cluster.ctx_url) == prompt_tokens  # all of it: no prefix-cache hit
    assert prefill_tokens(cluster.gen_url) == 0  # the gen leg pulled the KV and scored nothing again
    assert choice.text == alone.text and choice.logprobs.tokens == alone.logprobs.tokens
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(alone.logprobs.token_logprobs[1:], abs=1e-5)
    assert choice.logprobs.text_offset == alone.logprobs.text_offset
    ours, theirs = choice.model_extra["prompt_logprobs"], alone.model_extra["prompt_logprobs"]
    assert len(ours) == prompt_tokens and ours[0] is None
    assert [sorted(e) for e in ours[1:]] == [sorted(e) for e in theirs[1:]]

    streamed: list = []
    stream_ask = {**ask, "extra_body": {"ignore_eos": True}}
    for chunk in cluster.openai().completions.create(**stream_ask, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed[0] is None and streamed[1:] == pytest.approx(alone.logprobs.token_logprobs[1:], abs=1e-5)


def test_chat_prompt_logprobs_with_n_choices(cluster):
    ask = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "n": 2, "seed": 9,
           "temperature": 1.0, "extra_body": {"ignore_eos": True, "prompt_logprobs": 2}}
    alone = direct(cluster).chat.completions.with_raw_response.create(**ask).http_response.json()
    raw = cluster.openai().chat.completions.with_raw_response.create(**ask)
    assert raw.headers["x-disagg-mode"] == "disagg"
    body = raw.http_response.json()
    assert [c["message"]["content"] for c in body["choices"]] == [c["message"]["content"] for c in alone["choices"]]
    ours, theirs = body["prompt_logprobs"], alone["prompt_logprobs"]
    assert ours[0] is None and len(ours) == body["usage"]["prompt_tokens"] == len(theirs)
    for mine, other in zip(ours[1:], theirs[1:]):
        assert sorted(mine) == sorted(other)
        assert [mine[k]["logprob"] for k in sorted(mine)] == pytest.approx(
            [other[k]["logprob"] for k in sorted(other)], abs=1e-5)


def test_streamed_prompt_logprobs_are_refused_at_the_orchestrator(cluster):
    with pytest.raises(openai.BadRequestError) as error:
        cluster.openai().completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True,
                                            extra_body={"prompt_logprobs": 1})
    assert error.value.body["param"] == "prompt_logprobs", error.value.body
