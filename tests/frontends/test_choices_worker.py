"""n > 1 and echo on a real worker (tiny torch model: real tokens), through the official openai SDK.

- n choices, streamed and not, assemble to the same answers; with a seed each choice is reproducible
  and choice i is the n=1 answer with seed + i; usage counts the prompt once;
- the prompt is prefilled once: the other choices compute only its last partial block (the engine's
  own step stats, ``GET /metrics``);
- completions ``echo`` prepends the prompt (with its logprobs: tests/frontends/test_prompt_logprobs_worker.py);
  what is not supported is a 400 naming its parameter.
"""

from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "tiny-test"
USER = [{"role": "user", "content": "Name three colours of the evening sky over the sea, please."}]


def chat(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=1.0,
                                          extra_body={"ignore_eos": True}, **kwargs)


def test_chat_n_choices_are_reproducible_per_choice(torch_openai):
    three = chat(torch_openai, n=3, seed=11)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    assert len(set(texts)) > 1, texts  # sampled: the choices differ
    assert [c.message.content for c in chat(torch_openai, n=3, seed=11).choices] == texts
    for index, text in enumerate(texts):  # choice i is the n=1 answer with seed + i
        assert chat(torch_openai, seed=11 + index).choices[0].message.content == text
    single = chat(torch_openai, seed=11)
    assert three.usage.prompt_tokens == single.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * 8
    assert three.usage.total_tokens == three.usage.prompt_tokens + 24


def test_chat_n_streamed_assembles_to_the_same_choices(torch_openai):
    whole = chat(torch_openai, n=3, seed=5)
    texts, finishes, usage = ["", "", ""], [None, None, None], None
    for chunk in chat(torch_openai, n=3, seed=5, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == ["length"] * 3
    assert usage is not None and usage.completion_tokens == 24 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_the_prompt_is_prefilled_once(torch_worker, torch_openai):
    block_size = httpx.get(torch_worker + "/worker_info").json()["block_size"]
    long_user = [{"role": "user", "content": " ".join(f"word{i}" for i in range(120))}]
    httpx.get(torch_worker + "/metrics")  # drain what came before
    answer = torch_openai.chat.completions.create(model=MODEL, messages=long_user, max_tokens=2, n=4,
                                                  temperature=1.0, seed=1, extra_body={"ignore_eos": True})
    prompt = answer.usage.prompt_tokens
    prefill = sum(s["num_prefill_tokens"] for s in httpx.get(torch_worker + "/metrics").json())
    assert prompt > 4 * block_size
    # choice 0 prefills the prompt; choices 1-3 only its last partial block (at least one token each)
    assert prompt + 3 <= prefill <= prompt + 3 * block_size, (prompt, prefill, block_size)


def test_completions_n_and_echo(torch_openai):
    prompt = "The evening sky over the sea"
    echoed = torch_openai.completions.create(model=MODEL, prompt=prompt, max_tokens=6, n=2, seed=3, echo=True,
                                             extra_body={"ignore_eos": True})
    plain = torch_openai.completions.create(model=MODEL, prompt=prompt, max_tokens=6, n=2, seed=3,
                                            extra_body={"ignore_eos": True})
    assert [c.text for c in echoed.choices] == [prompt + c.text for c in plain.choices]
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens == 12
    streamed = ["", ""]
    for chunk in torch_openai.completions.create(model=MODEL, prompt=prompt, max_tokens=6, n=2, seed=3, echo=True,
                                                 stream=True, extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in echoed.choices]


@pytest.mark.parametrize("kwargs, param", [
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"n": 2, "best_of": 3}, "best_of"),
    ({"logprobs": 1, "stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
])
def test_what_is_not_supported_is_a_400_naming_it(torch_openai, kwargs, param):
    with pytest.raises(openai.BadRequestError) as error:
        torch_openai.completions.create(model=MODEL, prompt="Hello", max_tokens=2, **kwargs)
    assert error.value.body["param"] == param, error.value.body
    with pytest.raises(openai.BadRequestError) as error:
        torch_openai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, n=0)
    assert error.value.body["param"] == "n"


def test_best_of_equal_to_n_is_accepted(torch_openai):
    answer = torch_openai.completions.create(model=MODEL, prompt="Hello", max_tokens=2, n=2, best_of=2)
    assert len(answer.choices) == 2
