"""Prompt logprobs on a real worker (tiny torch model), through the official openai SDK, against
transformers' log_softmax of the full-sequence logits: ``echo`` with ``logprobs`` on completions
(OpenAI's legacy shape), streamed and not, with ``n`` > 1, and vLLM's ``prompt_logprobs`` on
completions and chat; bad values are a 400 naming the field."""

from __future__ import annotations

import os

import openai
import pytest

torch = pytest.importorskip("torch")
os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers reads it; nothing may be downloaded

from transformers import AutoModelForCausalLM  # noqa: E402

MODEL = "tiny-test"
PROMPT = [5, 47, 268, 290, 228, 42, 72, 77, 418, 228, 441, 263, 170, 252, 237, 422, 254, 230]
ASK = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> torch.Tensor:
    """Row p: log_softmax of transformers' logits after prompt position p (scores token p + 1)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0], dim=-1)


def _assert_prompt_part(logprobs, reference: torch.Tensor, top_n: int) -> None:
    count = len(PROMPT)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = [reference[p][PROMPT[p + 1]].item() for p in range(count - 1)]
    assert logprobs.token_logprobs[1:count] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) == top_n for top in logprobs.top_logprobs[1:count])
    best = [reference[p].max().item() for p in range(count - 1)]
    assert [max(top.values()) for top in logprobs.top_logprobs[1:count]] == pytest.approx(best, abs=1e-4)


def test_echo_with_logprobs_leads_with_the_prompts(torch_openai, reference):
    plain = torch_openai.completions.create(**ASK, logprobs=2)
    echoed = torch_openai.completions.create(**ASK, logprobs=2, echo=True)
    choice, count = echoed.choices[0], len(PROMPT)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == count + 4
    _assert_prompt_part(logprobs, reference, 2)
    # The generated tokens follow, as a plain request reports them, their offsets past the echoed prompt.
    assert logprobs.tokens[count:] == plain.choices[0].logprobs.tokens
    assert logprobs.token_logprobs[count:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    echo_len = len(choice.text) - len(plain.choices[0].text)
    assert logprobs.text_offset[count] == echo_len
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0


def test_echo_with_logprobs_streamed_and_with_n_choices(torch_openai, reference):
    whole = torch_openai.completions.create(**ASK, logprobs=1, echo=True)
    texts, tokens, values = "", [], []
    for chunk in torch_openai.completions.create(**ASK, logprobs=1, echo=True, stream=True):
        choice = chunk.choices[0]
        texts += choice.text
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens
            values += choice.logprobs.token_logprobs
    assert texts == whole.choices[0].text and tokens == whole.choices[0].logprobs.tokens
    assert values[0] is None and values[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:], abs=1e-5)

    two = torch_openai.completions.create(**{**ASK, "temperature": 1.0}, n=2, seed=3, logprobs=1, echo=True)
    for choice in two.choices:  # every choice leads with the same prompt logprobs (choice 0's)
        _assert_prompt_part(choice.logprobs, reference, 1)
    streamed: list[list] = [[], []]
    for chunk in torch_openai.completions.create(**{**ASK, "temperature": 1.0}, n=2, seed=3, logprobs=1, echo=True,
                                                 stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed[choice.index] += choice.logprobs.token_logprobs
    for index, choice in enumerate(two.choices):
        assert streamed[index][0] is None
        assert streamed[index][1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-5)


def _assert_vllm_shape(prompt_logprobs: list, reference: torch.Tensor, top_n: int, prompt: list[int]) -> None:
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for position, entry in enumerate(prompt_logprobs[1:]):
        row, token_id = reference[position], prompt[position + 1]
        own = entry[str(token_id)]
        assert own["logprob"] == pytest.approx(row[token_id].item(), abs=1e-4)
        assert own["rank"] == int((row > row[token_id]).sum().item()) + 1
        assert isinstance(own["decoded_token"], str)
        top = row.topk(top_n).indices.tolist()
        assert set(entry) == {str(token_id)} | {str(t) for t in top}
        assert [entry[str(t)]["rank"] for t in top if t != token_id] == [
            rank for rank, t in enumerate(top, 1) if t != token_id]


def test_vllm_prompt_logprobs_on_completions_and_chat(torch_openai, reference, tiny_model_dir):
    answer = torch_openai.completions.create(**{**ASK, "extra_body": {"ignore_eos": True, "prompt_logprobs": 3}})
    _assert_vllm_shape(answer.choices[0].model_extra["prompt_logprobs"], reference, 3, PROMPT)
    assert answer.choices[0].logprobs is None  # the generated tokens' were not asked for

    chat = torch_openai.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "The sea at dusk"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0})
    body = chat.http_response.json()
    prompt_logprobs = body["prompt_logprobs"]
    assert len(prompt_logprobs) == body["usage"]["prompt_tokens"] and prompt_logprobs[0] is None
    assert all(len(entry) == 1 for entry in prompt_logprobs[1:])  # only the prompt token itself
    assert all(next(iter(entry.values()))["logprob"] <= 0.0 for entry in prompt_logprobs[1:])


@pytest.mark.parametrize("extra, param", [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
])
def test_bad_prompt_logprobs_are_a_400_naming_them(torch_openai, extra, param):
    with pytest.raises(openai.BadRequestError) as error:
        torch_openai.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body=extra)
    assert error.value.body["param"] == param, error.value.body
    with pytest.raises(openai.BadRequestError) as error:
        torch_openai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                             extra_body=extra)
    assert error.value.body["param"] == param, error.value.body
    with pytest.raises(openai.BadRequestError) as error:
        torch_openai.completions.create(model=MODEL, prompt="Hello", max_tokens=2, echo=True, logprobs=21)
    assert error.value.body["param"] == "logprobs", error.value.body
