"""The HTTP API of a real worker: launcher + synthetic engine + 2 frontends on one port.

KV blocks after disconnects are checked exactly: after 50 mid-stream
disconnects, the engine's own stats (GET /metrics, drained through whichever
frontend answers) must show zero blocks in use once a last request has run.
"""

from __future__ import annotations

import asyncio
import time

import anthropic
import httpx
import openai
import pytest
from worker_process import start_worker, stop_worker

NUM_BLOCKS = 64
BLOCK_SIZE = 16
USER = [{"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=2, engine="synthetic", extra_args=[
        "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
        "--synthetic-decode-step-seconds", "0.004", "--served-model-name", "tiny",
    ])
    yield url
    assert stop_worker(proc) == 0


def fresh_connections(url: str) -> httpx.AsyncClient:
    # No keep-alive: every request is a new connection, which the kernel spreads over the frontends.
    return httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_keepalive_connections=0))


@pytest.mark.asyncio
async def test_openai_and_anthropic_clients_on_a_worker(worker):
    client = openai.AsyncOpenAI(base_url=worker + "/v1", api_key="unused", max_retries=0, timeout=30)
    chat = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=5, temperature=0)
    assert chat.usage.completion_tokens == 5
    stream = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=5, temperature=0,
                                                  stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == chat.choices[0].message.content
    completion = await client.completions.create(model="tiny", prompt="Hello", max_tokens=4)
    assert completion.usage.completion_tokens == 4

    claude = anthropic.AsyncAnthropic(base_url=worker, api_key="unused", max_retries=0, timeout=30)
    message = await claude.messages.create(model="tiny", max_tokens=5, messages=USER, extra_body={"temperature": 0})
    assert message.content[0].text == chat.choices[0].message.content  # same prompt, same greedy tokens
    async with claude.messages.stream(model="tiny", max_tokens=5, messages=USER,
                                      extra_body={"temperature": 0}) as events:
        assert "".join([t async for t in events.text_stream]) == message.content[0].text


@pytest.mark.asyncio
async def test_requests_spread_over_both_frontends(worker):
    async with fresh_connections(worker) as http:
        responses = await asyncio.gather(*(http.get("/health") for _ in range(40)))
    assert all(r.status_code == 200 for r in responses)
    assert {r.headers["x-disagg-frontend"] for r in responses} == {"0", "1"}


@pytest.mark.asyncio
async def test_fifty_disconnects_leave_the_block_pool_free(worker):
    frontends: set[str] = set()

    async def disconnect_mid_stream(http: httpx.AsyncClient, i: int) -> None:
        path, body, token_marker = (
            ("/v1/messages", {"messages": USER}, "content_block_delta") if i % 2 else
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Request {i}"}]}, '"content":"')
        )
        request = {"model": "tiny", "max_tokens": 150, "ignore_eos": True, "stream": True, **body}
        async with http.stream("POST", path, json=request) as response:
            assert response.status_code == 200
            frontends.add(response.headers["x-disagg-frontend"])
            async for line in response.aiter_lines():
                if token_marker in line and '"content":""' not in line:
                    break  # a generated token arrived: leave while the engine decodes
            else:
                raise AssertionError("the stream ended before the client could leave")

    async with fresh_connections(worker) as http:
        for wave in range(5):
            await asyncio.gather(*(disconnect_mid_stream(http, 10 * wave + i) for i in range(10)))
        assert frontends == {"0", "1"}
        # A one-token request is one engine step; the stats after it show the whole pool.
        # The aborts travel on other frontends' ingress, so give them a few rounds to land.
        last_stats: dict = {}
        for _ in range(20):
            await http.get("/metrics")
            response = await http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1})
            assert response.status_code == 200, response.text
            stats = (await http.get("/metrics")).json()
            assert stats, "the request ran no engine step"
            last_stats = stats[-1]
            if last_stats["kv_blocks_used"] == 0:
                break
            await asyncio.sleep(0.1)
    assert last_stats["kv_blocks_used"] == 0, last_stats
    assert (last_stats["num_running"], last_stats["num_waiting"]) == (0, 0)
    assert last_stats["kv_blocks_total"] == NUM_BLOCKS


def test_each_api_puts_the_request_x_request_id_on_its_perf_record(worker):
    """The handler hands the header to the engine client explicitly: every generation route's record
    carries its own request's id, whichever frontend served it."""
    ids = {api: f"explicit-{api}" for api in ("completions", "chat", "responses", "messages")}
    oai = openai.OpenAI(base_url=f"{worker}/v1", api_key="unused")
    oai.completions.create(model="tiny", prompt="Hi", max_tokens=3,
                           extra_headers={"x-request-id": ids["completions"]})
    oai.chat.completions.create(model="tiny", messages=USER, max_tokens=3,
                                extra_headers={"x-request-id": ids["chat"]})
    oai.responses.create(model="tiny", input="Hi", max_output_tokens=3, store=False,
                         extra_headers={"x-request-id": ids["responses"]})
    anthropic.Anthropic(base_url=worker, api_key="unused").messages.create(
        model="tiny", messages=USER, max_tokens=3, extra_headers={"x-request-id": ids["messages"]})
    seen: set[str] = set()
    for _ in range(50):  # attached frontends ship their records within FLUSH_SECONDS
        seen |= {r["x_request_id"] for r in httpx.get(f"{worker}/perf_metrics").json()}
        if set(ids.values()) <= seen:
            break
        time.sleep(0.05)
    assert set(ids.values()) <= seen
