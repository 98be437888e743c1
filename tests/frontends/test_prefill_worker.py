"""Assistant prefill on every API, Responses include/conversation, unknown fields: a real worker
(tiny torch model), through the official openai SDK.

- chat ``continue_final_message`` (vLLM's rules) continues the last assistant message: the same tokens as
  /v1/completions on the prompt /tokenize renders; the Responses API continues an assistant message
  last in its input the same way;
- Responses ``include: ["message.output_text.logprobs"]`` gives the output text's logprobs, streamed and
  not; ``conversation`` is a 400 naming it;
- unknown top-level fields: ignored and named in a ``Warning`` header by default, a 400 naming the field
  on a worker started with ``--strict-request-fields``.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from worker_process import start_worker, stop_worker

MODEL = "tiny-test"
PREFILL = [{"role": "user", "content": "Describe the sea."}, {"role": "assistant", "content": "The sea is"}]


def continued(client: openai.OpenAI) -> str:
    return client.chat.completions.create(
        model=MODEL, messages=PREFILL, max_tokens=6, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True},
    ).choices[0].message.content


def test_chat_continues_the_final_assistant_message(torch_worker, torch_openai):
    ids = httpx.post(torch_worker + "/tokenize", json={
        "model": MODEL, "messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True,
    }).json()["tokens"]
    text = httpx.post(torch_worker + "/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    assert text.endswith("The sea is")  # no end of turn after the prefill
    completion = torch_openai.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                                 extra_body={"ignore_eos": True})
    assert continued(torch_openai) == completion.choices[0].text
    new_turn = torch_openai.chat.completions.create(model=MODEL, messages=PREFILL, max_tokens=6, temperature=0,
                                                    extra_body={"ignore_eos": True})
    assert new_turn.usage.prompt_tokens > len(ids)  # the default closes the turn and opens the next


@pytest.mark.parametrize("extra, messages, says", [
    ({"continue_final_message": True}, PREFILL, "add_generation_prompt"),
    ({"continue_final_message": True, "add_generation_prompt": False}, PREFILL[:1], "'user'"),
])
def test_prefill_misuse_is_a_400_naming_it(torch_openai, extra, messages, says):
    with pytest.raises(openai.BadRequestError) as error:
        torch_openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)
    assert error.value.body["param"] == "continue_final_message" and says in error.value.body["message"]


def test_responses_continue_an_assistant_message_last_in_input(torch_openai):
    response = torch_openai.responses.create(model=MODEL, input=PREFILL, max_output_tokens=6, temperature=0)
    assert response.output_text == continued(torch_openai)


def test_responses_include_output_text_logprobs(torch_openai):
    ask = {"model": MODEL, "input": "Tell me about the sea", "max_output_tokens": 5, "temperature": 0,
           "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    response = torch_openai.responses.create(**ask)
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == 5 and all(len(entry.top_logprobs) == 2 for entry in logprobs)
    assert "".join(entry.token for entry in logprobs) == response.output_text
    events = list(torch_openai.responses.create(**ask, stream=True))
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert [entry.token for event in deltas for entry in event.logprobs] == [entry.token for entry in logprobs]
    completed = events[-1].response.output[0].content[0].logprobs
    assert [entry.token for entry in completed] == [entry.token for entry in logprobs]
    plain = torch_openai.responses.create(model=MODEL, input="Tell me about the sea", max_output_tokens=5)
    assert not plain.output[0].content[0].logprobs


def test_responses_conversation_is_a_400_naming_it(torch_openai):
    with pytest.raises(openai.BadRequestError) as error:
        torch_openai.responses.create(model=MODEL, input="hi", max_output_tokens=2,
                                      extra_body={"conversation": "conv_1"})
    assert error.value.body["param"] == "conversation" and "previous_response_id" in error.value.body["message"]


def test_unknown_fields_are_ignored_with_a_warning_header(torch_openai):
    raw = torch_openai.chat.completions.with_raw_response.create(
        model=MODEL, messages=PREFILL[:1], max_tokens=2, extra_body={"max_token": 5, "vendor_extra": {"a": 1}})
    assert raw.headers["warning"] == '299 - "unknown fields ignored: max_token, vendor_extra"'
    assert raw.parse().choices[0].message.content is not None
    clean = torch_openai.chat.completions.with_raw_response.create(model=MODEL, messages=PREFILL[:1], max_tokens=2)
    assert "warning" not in clean.headers
    for call in (lambda: torch_openai.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=2,
                                                                           extra_body={"foo": 1}),
                 lambda: torch_openai.responses.with_raw_response.create(model=MODEL, input="x", max_output_tokens=2,
                                                                         extra_body={"foo": 1})):
        assert call().headers["warning"] == '299 - "unknown fields ignored: foo"'


def test_strict_request_fields_refuse_them(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=1, engine="synthetic",
                             extra_args=["--strict-request-fields"])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for call in (lambda: client.chat.completions.create(model=MODEL, messages=PREFILL[:1], max_tokens=2,
                                                            extra_body={"max_token": 5}),
                     lambda: client.responses.create(model=MODEL, input="x", max_output_tokens=2,
                                                     extra_body={"max_token": 5})):
            with pytest.raises(openai.BadRequestError) as error:
                call()
            assert error.value.body["param"] == "max_token" and "strict_request_fields" in error.value.body["message"]
        assert client.chat.completions.create(model=MODEL, messages=PREFILL[:1], max_tokens=2).choices
        messages = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 2, "foo": 1,
                                                          "messages": PREFILL[:1]})
        assert messages.status_code == 400 and messages.json()["error"]["type"] == "invalid_request_error"
    finally:
        assert stop_worker(proc) == 0
