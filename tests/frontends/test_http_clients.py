"""The official openai and anthropic clients against a real uvicorn on 127.0.0.1,
and client disconnects that must abort the request in the engine."""

from __future__ import annotations

import asyncio

import anthropic
import openai
import pytest
from http_harness import engine_output_ids

from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio

USER = [{"role": "user", "content": "Hello world"}]


def openai_client(harness) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(harness.http.base_url).rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=10)


def anthropic_client(harness) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=str(harness.http.base_url).rstrip("/"), api_key="unused",
                                    max_retries=0, timeout=10)


async def test_openai_client(live_server):
    client = openai_client(live_server)
    expected = live_server.tokenizer.decode(engine_output_ids(
        live_server.tokenizer.encode_chat(USER), SamplingParams(max_tokens=6, temperature=0.0)))

    chat = await client.chat.completions.create(model="tiny-test", messages=USER, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == expected
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 6

    stream = await client.chat.completions.create(model="tiny-test", messages=USER, max_tokens=6, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 6

    completion = await client.completions.create(model="tiny-test", prompt="Hello", max_tokens=5, temperature=0)
    assert completion.usage.completion_tokens == 5
    stream = await client.completions.create(model="tiny-test", prompt="Hello", max_tokens=5, temperature=0,
                                             stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == completion.choices[0].text

    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny-test"]
    with pytest.raises(openai.NotFoundError) as excinfo:
        await client.chat.completions.create(model="nope", messages=USER)
    assert excinfo.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="tiny-test", messages=USER, temperature=-2)
    raw = await client.chat.completions.with_raw_response.create(model="tiny-test", messages=USER, max_tokens=1)
    assert raw.headers["x-disagg-frontend"] == "7"


async def test_anthropic_client(live_server):
    client = anthropic_client(live_server)
    # This anthropic client version has no temperature argument: it travels in the body.
    greedy = {"temperature": 0}
    message = await client.messages.create(model="tiny-test", max_tokens=6, system="Be brief.", messages=USER,
                                           extra_body=greedy)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 6
    async with client.messages.stream(model="tiny-test", max_tokens=6, system="Be brief.", messages=USER,
                                      extra_body=greedy) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == message.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    count = await client.messages.count_tokens(model="tiny-test", system="Be brief.", messages=USER)
    assert count.input_tokens == message.usage.input_tokens
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.create(model="nope", max_tokens=3, messages=USER)
    with pytest.raises(anthropic.BadRequestError):
        await client.messages.create(model="tiny-test", max_tokens=0, messages=USER)


async def wait_for_abort(harness, num_aborts: int) -> None:
    for _ in range(300):
        if harness.client.num_aborts >= num_aborts and not harness.core.has_unfinished():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{harness.client.num_aborts} aborts, engine busy: {harness.core.has_unfinished()}")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hello"}),
    ("/v1/chat/completions", {"messages": USER}),
    ("/v1/messages", {"messages": USER}),
])
async def test_disconnect_mid_stream_aborts_in_engine(live_server, path, body):
    request = {"model": "tiny-test", "max_tokens": 200, "ignore_eos": True, "stream": True, **body}
    async with live_server.http.stream("POST", path, json=request) as response:
        assert response.status_code == 200
        received = 0
        async for _ in response.aiter_raw():
            received += 1
            if received == 3:
                break  # the client goes away while the engine is decoding
    assert live_server.core.has_unfinished()
    await wait_for_abort(live_server, 1)
    live_server.assert_engine_idle()


async def test_disconnect_while_waiting_for_non_streaming_answer_aborts(live_server):
    request = {"model": "tiny-test", "max_tokens": 200, "prompt": "Hello"}
    task = asyncio.create_task(live_server.http.post("/v1/completions", json=request))
    while not live_server.core.has_unfinished():
        await asyncio.sleep(0.005)
    task.cancel()  # closes the connection
    await asyncio.gather(task, return_exceptions=True)
    await wait_for_abort(live_server, 1)
    live_server.assert_engine_idle()


async def test_many_disconnects_leave_no_blocks(live_server):
    async def disconnect_after_first_token(i: int) -> None:
        request = {"model": "tiny-test", "max_tokens": 200, "prompt": f"Request {i}", "stream": True}
        async with live_server.http.stream("POST", "/v1/completions", json=request) as response:
            async for _ in response.aiter_raw():
                break

    await asyncio.gather(*(disconnect_after_first_token(i) for i in range(20)))
    await wait_for_abort(live_server, 20)
    assert live_server.client.num_aborts == 20
    live_server.assert_engine_idle()
