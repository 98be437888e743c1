"""api.response_ids: answer ids keep uuid4's shape and never repeat."""

from __future__ import annotations

import re

import pytest

from api.response_ids import ResponseIds

HEX32 = re.compile(r"[0-9a-f]{32}")


def test_ids_are_32_hex_digits_and_unique_within_and_across_processes():
    first, second = ResponseIds(), ResponseIds()  # two processes' sources
    ids = [first.next_hex() for _ in range(10_000)] + [second.next_hex() for _ in range(10_000)]
    assert all(HEX32.fullmatch(i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert ids[0][:16] != ids[10_000][:16]  # each source draws its own random prefix


@pytest.mark.asyncio
async def test_chat_and_completion_answers_carry_distinct_ids(harness):
    seen = set()
    for path, body, prefix in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "chatcmpl-"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "chatcmpl-"),
        ("/v1/completions", {"prompt": "Hi"}, "cmpl-"),
    ]:
        response = await harness.http.post(path, json={"model": harness.model, "max_tokens": 2, **body})
        answer_id = response.json()["id"]
        assert answer_id.startswith(prefix) and HEX32.fullmatch(answer_id[len(prefix):]), answer_id
        seen.add(answer_id)
    response = await harness.http.post("/v1/messages", json={"model": harness.model, "max_tokens": 2,
                                                             "messages": [{"role": "user", "content": "Hi"}]})
    assert HEX32.fullmatch(response.json()["id"].removeprefix("msg_"))
    assert len(seen) == 3
