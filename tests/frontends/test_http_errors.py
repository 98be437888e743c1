"""Every bad-input class gets a 4xx in the API's error shape, never a 500."""

from __future__ import annotations

import pytest
from http_harness import MAX_MODEL_LEN

pytestmark = pytest.mark.asyncio

USER = [{"role": "user", "content": "Hello"}]


def openai_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert response.headers["x-disagg-frontend"] == "7"
    return error


def anthropic_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_malformed_json(harness, path):
    error = openai_error(await harness.http.post(path, content=b'{"model": "tiny-test", "prompt": '), 400)
    assert error["type"] == "invalid_request_error" and "malformed JSON" in error["message"]


async def test_malformed_json_anthropic(harness):
    error = anthropic_error(await harness.http.post("/v1/messages", content=b"[1, 2"), 400)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"model": "tiny-test", "prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"model": "tiny-test", "prompt": 5}, "prompt"),
    ({"model": "tiny-test", "prompt": "x", "stop": [1]}, "stop[0]"),
    ({"prompt": "x"}, None),  # model missing
])
async def test_wrong_types_completions(harness, body, param):
    error = openai_error(await harness.http.post("/v1/completions", json=body), 400)
    if param is not None:
        assert error["param"] == param
    else:
        assert "model" in error["message"]


async def test_wrong_content_part_type_chat(harness):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    response = await harness.http.post("/v1/chat/completions", json={"model": "tiny-test", "messages": messages})
    assert openai_error(response, 400)["param"] == "messages[0].content[0].type"


async def test_wrong_types_anthropic(harness):
    response = await harness.http.post("/v1/messages", json={"model": "tiny-test", "messages": USER})
    assert "max_tokens" in anthropic_error(response, 400)["message"]  # required
    response = await harness.http.post("/v1/messages", json={
        "model": "tiny-test", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]})
    anthropic_error(response, 400)


@pytest.mark.parametrize("field, value", [
    ("temperature", -1.0), ("top_p", 1.5), ("top_k", -7), ("max_tokens", 0), ("logprobs", 50), ("seed", -1),
    ("min_tokens", 99),
])
async def test_out_of_range_completions(harness, field, value):
    body = {"model": "tiny-test", "prompt": "x", "max_tokens": 8, field: value}
    error = openai_error(await harness.http.post("/v1/completions", json=body), 400)
    assert field in error["message"]


async def test_out_of_range_chat_and_anthropic(harness):
    chat = await harness.http.post("/v1/chat/completions", json={
        "model": "tiny-test", "messages": USER, "top_logprobs": 3, "logprobs": True, "temperature": 500})
    assert "temperature" in openai_error(chat, 400)["message"]
    messages = await harness.http.post("/v1/messages", json={
        "model": "tiny-test", "messages": USER, "max_tokens": -3})
    assert "max_tokens" in anthropic_error(messages, 400)["message"]


async def test_unsupported_options(harness):
    error = openai_error(await harness.http.post("/v1/completions", json={"model": "tiny-test", "prompt": "x", "n": 0}), 400)
    assert error["param"] == "n" and "[1, 128]" in error["message"]
    error = openai_error(await harness.http.post("/v1/chat/completions", json={
        "model": "tiny-test", "messages": USER, "top_logprobs": 2}), 400)
    assert error["param"] == "top_logprobs"
    error = openai_error(await harness.http.post("/v1/completions", json={
        "model": "tiny-test", "prompt": [1, 2, 100000]}), 400)
    assert "100000" in error["message"]


async def test_prompt_too_long(harness):
    long_prompt = list(range(10, 10 + MAX_MODEL_LEN))
    error = openai_error(await harness.http.post("/v1/completions", json={
        "model": "tiny-test", "prompt": long_prompt, "max_tokens": 1}), 400)
    assert error["code"] == "context_length_exceeded"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    # Fits alone, but not with max_tokens: the message says how far to lower it.
    prompt = list(range(10, 10 + MAX_MODEL_LEN - 20))
    error = openai_error(await harness.http.post("/v1/completions", json={
        "model": "tiny-test", "prompt": prompt, "max_tokens": 50}), 400)
    assert error["param"] == "max_tokens"
    assert f"{MAX_MODEL_LEN - 20} prompt tokens + 50 max_tokens = {MAX_MODEL_LEN + 30}" in error["message"]
    assert "at most 20" in error["message"]
    # max_tokens is not clamped, but chat's default takes exactly the room left.
    ok = await harness.http.post("/v1/completions", json={"model": "tiny-test", "prompt": prompt, "max_tokens": 20})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 20
    text = " ".join(["word"] * MAX_MODEL_LEN)
    error = anthropic_error(await harness.http.post("/v1/messages", json={
        "model": "tiny-test", "max_tokens": 5, "messages": [{"role": "user", "content": text}]}), 400)
    assert f"maximum context length is {MAX_MODEL_LEN}" in error["message"]


async def test_unknown_model(harness):
    error = openai_error(await harness.http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": USER}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-9" in error["message"]
    error = anthropic_error(await harness.http.post("/v1/messages", json={
        "model": "claude-9", "max_tokens": 3, "messages": USER}), 404)
    assert error["type"] == "not_found_error"
    error = anthropic_error(await harness.http.post("/v1/messages/count_tokens", json={
        "model": "claude-9", "messages": USER}), 404)


async def test_unknown_route_and_method(harness):
    assert openai_error(await harness.http.get("/v1/nothing"), 404)["code"] == "not_found"
    assert anthropic_error(await harness.http.get("/v1/messages/nothing/here"), 404)["type"] == "not_found_error"
    for method, path, allow in (("GET", "/v1/completions", "POST"), ("DELETE", "/v1/models", "GET"),
                                ("GET", "/v1/chat/completions", "POST")):
        response = await harness.http.request(method, path)
        error = openai_error(response, 405)
        assert error["code"] == "method_not_allowed" and allow in response.headers["allow"].split(", ")
    response = await harness.http.get("/v1/messages")
    anthropic_error(response, 405)
    assert response.headers["allow"] == "POST"


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": None}, *USER]}, "messages[0].content"),
    ({"messages": [*USER, {"role": "assistant"}]}, "messages[1].content"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "c1"}]}, "messages[1].content"),
    ({"messages": USER, "stop": [""]}, "stop[0]"),
    ({"messages": USER, "stop": ""}, "stop"),
    ({"messages": USER, "stop": [""] * 1000}, "stop"),
    ({"messages": USER, "stop": ["x"] * 17}, "stop"),
    ({"messages": USER, "stop": ["x" * 1025]}, "stop[0]"),
    ({"messages": USER * 4097}, "messages"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
     "tools"),
    ({"messages": USER, "stop_token_ids": [1] * 257}, "stop_token_ids"),
    ({"messages": USER, "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"messages": USER, "guided_choice": [f"c{i}" for i in range(1025)]}, "guided_choice"),
])
async def test_bad_input_corpus_chat(harness, body, param):
    """Each used to be accepted (a message without content generated to the end of the context)."""
    response = await harness.http.post("/v1/chat/completions", json={"model": "tiny-test", **body})
    assert openai_error(response, 400)["param"] == param


async def test_bounded_inputs_at_their_limits_are_served(harness):
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [*USER, {"role": "assistant", "tool_calls": calls}, {"role": "tool", "tool_call_id": "c1",
                                                                    "content": "ok"}]
    response = await harness.http.post("/v1/chat/completions", json={
        "model": "tiny-test", "messages": messages, "max_tokens": 2, "stop": ["x" * 1024] + ["y"] * 15,
        "stop_token_ids": [1] * 256, "logit_bias": {str(i): 0 for i in range(500)}})
    assert response.status_code == 200, response.text
    response = await harness.http.post("/v1/completions", json={"model": "tiny-test", "prompt": "hi",
                                                                "max_tokens": 2, "stop": "z"})
    assert response.status_code == 200, response.text


async def test_bad_input_corpus_completions_and_anthropic(harness):
    error = openai_error(await harness.http.post("/v1/completions", json={
        "model": "tiny-test", "prompt": "hi", "stop": ["a", ""]}), 400)
    assert error["param"] == "stop[1]"
    for body, what in (({"stop_sequences": [""]}, "empty"), ({"stop_sequences": ["x"] * 17}, "at most 16"),
                       ({"messages": USER * 4097}, "at most 4096"),
                       ({"messages": [{"role": "user"}]}, "content")):
        response = await harness.http.post("/v1/messages", json={"model": "tiny-test", "max_tokens": 4,
                                                                 "messages": USER, **body})
        assert what in anthropic_error(response, 400)["message"]


async def test_unexpected_engine_failure_is_a_shaped_error_not_a_crash(harness):
    async def broken_generate(*args, **kwargs):
        raise RuntimeError("boom")
        yield  # pragma: no cover - makes this an async generator

    def broken_open_stream(*args, **kwargs):  # the streamed path (api.push_stream)
        raise RuntimeError("boom")

    harness.client.generate = broken_generate
    harness.client.open_stream = broken_open_stream
    response = await harness.http.post("/v1/completions", json={"model": "tiny-test", "prompt": "x"})
    error = openai_error(response, 500)
    assert error["type"] == "internal_error" and "boom" not in error["message"]
    streamed = await harness.http.post("/v1/completions", json={"model": "tiny-test", "prompt": "x", "stream": True})
    assert streamed.status_code == 200
    assert '"type":"internal_error"' in streamed.text and streamed.text.endswith("data: [DONE]\n\n")
