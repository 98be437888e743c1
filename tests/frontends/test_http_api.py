"""Every endpoint through the ASGI app and the real (synthetic) EngineCore in-process."""

from __future__ import annotations

import json

import pytest
from http_harness import FRONTEND_ID, MAX_MODEL_LEN, engine_output_ids, make_harness

from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]


def sse_data(text: str) -> list[dict | str]:
    events = []
    for line in text.split("\n"):
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def stop_across_boundary(tokenizer, tokens: list[int]) -> tuple[str, int]:
    """A 5-character stop string of printable text that starts 2 characters before
    the end of one token's text and runs into the next tokens; and that boundary."""
    full = tokenizer.decode(tokens)
    for i in range(3, len(tokens)):
        boundary = len(tokenizer.decode(tokens[:i]))
        stop = full[boundary - 2: boundary + 3]
        if len(stop) == 5 and stop.isprintable() and "\ufffd" not in stop and full.find(stop) == boundary - 2:
            return stop, boundary
    raise AssertionError("no clean token boundary in the engine's output")


async def test_completion_greedy_equals_engine_output(harness):
    prompt = "The quick brown fox"
    response = await harness.http.post("/v1/completions", json={
        "model": harness.model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
    })
    assert response.status_code == 200
    assert response.headers["x-disagg-frontend"] == str(FRONTEND_ID)
    body = response.json()
    prompt_ids = harness.tokenizer.encode(prompt)
    expected = engine_output_ids(prompt_ids, SamplingParams(max_tokens=12, temperature=0.0))
    assert len(expected) == 12
    assert body["choices"][0]["text"] == harness.tokenizer.decode(expected)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 12,
                             "total_tokens": len(prompt_ids) + 12, "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["object"] == "text_completion" and body["model"] == "tiny-test"
    harness.assert_engine_idle()


async def test_completion_token_id_prompt_and_streaming_with_usage(harness):
    prompt_ids = harness.tokenizer.encode("Hello world")
    response = await harness.http.post("/v1/completions", json={
        "model": harness.model, "prompt": prompt_ids, "max_tokens": 10, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    })
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_data(response.text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    chunks = events[:-2]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    expected = engine_output_ids(prompt_ids, SamplingParams(max_tokens=10, temperature=0.0))
    assert text == harness.tokenizer.decode(expected)


async def test_completion_logprobs(harness):
    response = await harness.http.post("/v1/completions", json={
        "model": harness.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "logprobs": 2,
    })
    logprobs = response.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 4
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"][0] == 0


async def test_stop_string_across_tokens_ends_request_and_aborts_engine(harness):
    prompt = "Hello world"
    prompt_ids = harness.tokenizer.encode(prompt)
    tokens = engine_output_ids(prompt_ids, SamplingParams(max_tokens=40, temperature=0.0))
    full = harness.tokenizer.decode(tokens)
    stop, boundary = stop_across_boundary(harness.tokenizer, tokens)
    assert full.find(stop) == boundary - 2
    response = await harness.http.post("/v1/completions", json={
        "model": harness.model, "prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": [stop, "zzzz"],
        "stream": True,
    })
    chunks = sse_data(response.text)[:-1]
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    assert text == full[: boundary - 2]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert harness.client.num_aborts == 1  # the engine did not run to max_tokens
    await harness.client.wait_idle()
    harness.assert_engine_idle()


async def test_chat_completion_and_stream_agree(harness):
    request = {"model": harness.model, "messages": CHAT, "max_completion_tokens": 9, "temperature": 0}
    full = (await harness.http.post("/v1/chat/completions", json=request)).json()
    assert full["object"] == "chat.completion"
    message = full["choices"][0]["message"]
    assert message["role"] == "assistant"
    prompt_ids = harness.tokenizer.encode_chat(CHAT)
    expected = engine_output_ids(prompt_ids, SamplingParams(max_tokens=9, temperature=0.0))
    assert message["content"] == harness.tokenizer.decode(expected)
    assert full["usage"]["prompt_tokens"] == len(prompt_ids)

    streamed = await harness.http.post("/v1/chat/completions", json={**request, "stream": True})
    events = sse_data(streamed.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-2])
    assert text == message["content"]


async def test_chat_content_parts_tools_and_logprobs(harness):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Paris?"}]}]
    response = await harness.http.post("/v1/chat/completions", json={
        "model": harness.model, "messages": messages, "tools": tools, "max_tokens": 3, "logprobs": True,
        "top_logprobs": 2, "temperature": 0,
    })
    assert response.status_code == 200
    body = response.json()
    rendered = harness.tokenizer.encode_chat([{"role": "user", "content": "Weather in\nParis?"}], tools=tools)
    assert body["usage"]["prompt_tokens"] == len(rendered)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(entry["top_logprobs"]) == 2 for entry in content)


async def test_chat_with_tool_call_and_tool_result(harness):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    response = await harness.http.post("/v1/chat/completions", json={
        "model": harness.model, "messages": messages, "max_tokens": 2})
    assert response.status_code == 200
    rendered = harness.tokenizer.render_chat(messages)
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in rendered
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n21 degrees<|eot_id|>" in rendered
    assert response.json()["usage"]["prompt_tokens"] == len(harness.tokenizer.encode(rendered, add_special_tokens=False))


async def test_anthropic_messages(harness):
    request = {"model": harness.model, "system": "Be brief.", "max_tokens": 7, "temperature": 0,
               "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello world"}]}]}
    response = await harness.http.post("/v1/messages", json=request)
    assert response.status_code == 200
    body = response.json()
    prompt_ids = harness.tokenizer.encode_chat(CHAT)
    expected = engine_output_ids(prompt_ids, SamplingParams(max_tokens=7, temperature=0.0))
    assert body["content"] == [{"type": "text", "text": harness.tokenizer.decode(expected)}]
    assert body["stop_reason"] == "max_tokens" and body["stop_sequence"] is None
    assert body["usage"] == {"input_tokens": len(prompt_ids), "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 0, "output_tokens": 7}

    streamed = await harness.http.post("/v1/messages", json={**request, "stream": True})
    names = [line[len("event: "):] for line in streamed.text.split("\n") if line.startswith("event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    events = sse_data(streamed.text)
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == body["content"][0]["text"]
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 7


async def test_anthropic_stop_sequence(harness):
    prompt_ids = harness.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    full = harness.tokenizer.decode(engine_output_ids(prompt_ids, SamplingParams(max_tokens=30, temperature=0.0)))
    stop = next(full[i:i + 2] for i in range(3, len(full)) if "\ufffd" not in full[i:i + 2] and full[i:i + 2].strip())
    response = await harness.http.post("/v1/messages", json={
        "model": harness.model, "max_tokens": 30, "temperature": 0, "stop_sequences": [stop],
        "messages": [{"role": "user", "content": "Hi"}],
    })
    body = response.json()
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == stop
    assert body["content"][0]["text"] == full[: full.find(stop)]


async def test_eos_gives_end_turn_and_stop(tiny_model_dir, tokenizer):
    # Every token id that the tiny vocabulary makes is an EOS: the first token ends the request.
    app, h = await make_harness(tiny_model_dir, tokenizer, eos=frozenset(range(512)))
    try:
        messages = [{"role": "user", "content": "Hi"}]
        anthropic = (await h.http.post("/v1/messages", json={"model": h.model, "max_tokens": 5, "messages": messages})).json()
        assert anthropic["stop_reason"] == "end_turn" and anthropic["usage"]["output_tokens"] == 1
        openai = (await h.http.post("/v1/chat/completions", json={"model": h.model, "messages": messages})).json()
        assert openai["choices"][0]["finish_reason"] == "stop"
    finally:
        await h.http.aclose()
        await h.client.close()


async def test_count_tokens_models_health_version(harness):
    count = await harness.http.post("/v1/messages/count_tokens", json={
        "model": harness.model, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": "Hello world"}],
    })
    assert count.json() == {"input_tokens": len(harness.tokenizer.encode_chat(CHAT))}
    models = (await harness.http.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["tiny-test"]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    health = await harness.http.get("/health")
    assert health.status_code == 200 and health.headers["x-disagg-frontend"] == str(FRONTEND_ID)
    assert (await harness.http.get("/version")).json() == {"version": "0.1.0"}


async def test_disaggregated_params_need_a_cluster_key(harness):
    response = await harness.http.post("/v1/completions", json={
        "model": harness.model, "prompt": "Hi", "max_tokens": 2,
        "disaggregated_params": {"request_type": "context_only"},
    })
    assert response.status_code == 400
    assert "no cluster key" in response.json()["error"]["message"]


async def test_dead_engine_is_503(harness):
    harness.client.healthy = False
    health = await harness.http.get("/health")
    assert health.status_code == 503
    assert health.json()["error"]["code"] == "engine_dead"
    chat = await harness.http.post("/v1/chat/completions", json={"model": harness.model, "messages": CHAT})
    assert chat.status_code == 503
    messages = await harness.http.post("/v1/messages", json={"model": harness.model, "max_tokens": 3,
                                                              "messages": [{"role": "user", "content": "x"}]})
    assert messages.status_code == 503 and messages.json()["type"] == "error"
