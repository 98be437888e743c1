"""Usage reports the prompt tokens served from the prefix cache (an aggregated worker, in-process engine)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.asyncio

MESSAGES = [{"role": "user", "content": "Tell me about prefix caching, twice over, in detail please."}]


def sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


async def test_a_repeated_prompt_reports_cached_tokens_on_both_apis(harness):
    block_size = harness.core.block_manager.block_size
    chat = {"model": harness.model, "messages": MESSAGES, "max_tokens": 3}
    first = (await harness.http.post("/v1/chat/completions", json=chat)).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    second = (await harness.http.post("/v1/chat/completions", json=chat)).json()["usage"]
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["prompt_tokens"] and cached % block_size == 0
    streamed = sse((await harness.http.post("/v1/chat/completions", json=chat | {
        "stream": True, "stream_options": {"include_usage": True}})).text)
    assert streamed[-1]["usage"] == second

    message = {"model": harness.model, "messages": MESSAGES, "max_tokens": 3}
    usage = (await harness.http.post("/v1/messages", json=message)).json()["usage"]
    assert usage == {"input_tokens": second["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
                     "cache_read_input_tokens": cached, "output_tokens": 3}
    events = sse((await harness.http.post("/v1/messages", json=message | {"stream": True})).text)
    final = next(e for e in events if e["type"] == "message_delta")["usage"]
    assert final == usage  # cumulative: the SDKs overwrite message_start's usage with it
    harness.assert_engine_idle()
