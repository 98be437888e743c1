"""stream_interval on a real worker: serve's --stream-interval, the request's field, through the official SDKs."""

from __future__ import annotations

import anthropic
import openai
import pytest
from worker_process import start_worker, stop_worker

USER = [{"role": "user", "content": "Tell me a story"}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=1, engine="synthetic", extra_args=[
        "--stream-interval", "4", "--synthetic-decode-step-seconds", "0.003", "--served-model-name", "tiny"])
    yield url
    assert stop_worker(proc) == 0


async def chat_stream(client: openai.AsyncOpenAI, **extra) -> list[str]:
    stream = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=MAX_TOKENS, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True, **extra})
    return [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]


@pytest.mark.asyncio
async def test_intervals_change_the_events_not_the_text(worker):
    client = openai.AsyncOpenAI(base_url=worker + "/v1", api_key="unused", max_retries=0, timeout=30)
    whole = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=MAX_TOKENS, temperature=0,
                                                 extra_body={"ignore_eos": True})
    every = await chat_stream(client, stream_interval=1)
    served = await chat_stream(client)  # the worker's --stream-interval 4: outputs of 1, 4, 4, 3 tokens
    one = await chat_stream(client, stream_interval=64)  # the first token, then the rest at once
    text = whole.choices[0].message.content
    assert "".join(every) == "".join(served) == "".join(one) == text
    assert len(every) > len(served)
    assert 1 <= len(served) <= 4 and 1 <= len(one) <= 2
    completion = await client.completions.create(model="tiny", prompt="Hello", max_tokens=MAX_TOKENS, stream=True,
                                                 extra_body={"ignore_eos": True, "stream_interval": 6})
    pieces = [c.choices[0].text async for c in completion if c.choices and c.choices[0].text]
    assert 1 <= len(pieces) <= 3


@pytest.mark.asyncio
async def test_anthropic_messages_take_the_field(worker):
    client = anthropic.AsyncAnthropic(base_url=worker, api_key="unused", max_retries=0, timeout=30)
    whole = await client.messages.create(model="tiny", messages=USER, max_tokens=MAX_TOKENS)
    deltas = []
    async with client.messages.stream(model="tiny", messages=USER, max_tokens=MAX_TOKENS,
                                      extra_body={"stream_interval": 64}) as stream:
        async for text in stream.text_stream:
            deltas.append(text)
    assert "".join(deltas) == whole.content[0].text
    assert 1 <= len(deltas) <= 2


@pytest.mark.asyncio
@pytest.mark.parametrize("value", [0, 1025, "four"])
async def test_out_of_range_interval_is_a_400_naming_it(worker, value):
    client = openai.AsyncOpenAI(base_url=worker + "/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="tiny", messages=USER, max_tokens=4, stream=True,
                                             extra_body={"stream_interval": value})
    assert "stream_interval" in str(caught.value)
    anthropic_client = anthropic.AsyncAnthropic(base_url=worker, api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(anthropic.BadRequestError) as refused:
        await anthropic_client.messages.create(model="tiny", messages=USER, max_tokens=4,
                                               extra_body={"stream_interval": value})
    assert "stream_interval" in str(refused.value)
