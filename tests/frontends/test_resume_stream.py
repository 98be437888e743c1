"""A resumed stream (``disaggregated_params.request_type: resume``, orchestrator.migration) writes
exactly what the uninterrupted stream wrote after the cut, whatever write it is cut after: the
worker replays the carried tokens through its detokenizer, stop strings and encoder unwritten.
Marks (``api.stream_marks``) name each write's tokens; unmarked streams carry none."""

from __future__ import annotations

import json

import pytest

from api.stream_marks import MARKS_HEADER, MarkReader

pytestmark = pytest.mark.asyncio

MARKED = {MARKS_HEADER: "1"}
CHAT = {"model": "tiny-test", "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 40, "stream": True, "ignore_eos": True, "temperature": 0,
        "stream_options": {"include_usage": True}}
MESSAGES = {"model": "tiny-test", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 40, "stream": True}


def events(data: bytes) -> list[dict]:
    """The data events, without what differs per worker by design (its prefix-cache hits)."""
    found = []
    for line in data.split(b"\n"):
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            if isinstance(event.get("message"), dict):
                event["message"].pop("id", None)
            # Prefix-cache hits are the worker's state, not the answer's: a resumed leg's differ.
            (event.get("usage") or {}).pop("prompt_tokens_details", None)
            for usage in (event.get("usage"), (event.get("message") or {}).get("usage")):
                if isinstance(usage, dict) and "input_tokens" in usage:  # Anthropic's: uncached + cached
                    usage["input_tokens"] += usage.pop("cache_read_input_tokens", 0)
            found.append(event)
    return found


async def marked_writes(h, path: str, body: dict) -> list:
    response = await h.http.post(path, json=body, headers=MARKED)
    assert response.status_code == 200, response.text
    reader = MarkReader()
    writes = reader.feed(response.content)
    assert reader.rest() == b"" and b": disagg" not in b"".join(w for w, _ in writes)
    return writes


def spy_prompts(client) -> list[list[int]]:
    """The prompt ids of every request the engine client is given, in order."""
    seen: list[list[int]] = []
    for name in ("generate", "open_stream"):
        original = getattr(client, name)

        def spy(prompt_token_ids, *args, _original=original, **kwargs):
            seen.append(list(prompt_token_ids))
            return _original(prompt_token_ids, *args, **kwargs)

        setattr(client, name, spy)
    return seen


def resume_body(body: dict, prompt_ids: list[int], carried: list[int], head: dict | None = None) -> dict:
    """``head``: the first event, whose id and creation time the resumed events repeat (OpenAI's)."""
    head = head or {}
    return {**body, "disaggregated_params": {"request_type": "resume", "prompt_token_ids": prompt_ids,
                                             "output_token_ids": carried, "response_id": head.get("id"),
                                             "created": head.get("created")}}


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/messages", MESSAGES)])
async def test_a_resumed_stream_goes_on_as_the_uninterrupted_one(harness, path, body):
    h = harness
    prompts = spy_prompts(h.client)
    plain = await h.http.post(path, json=body)
    assert b": disagg" not in plain.content  # unmarked without the header
    whole = await marked_writes(h, path, body)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events(b"".join(w for w, _ in whole))
                   if e.get("choices")) if path.endswith("completions") else None
    if text:  # a stop string late in the answer: the stop matcher's held-back text crosses the cuts
        body = {**body, "stop": [text[-6:-3]]}
        whole = await marked_writes(h, path, body)
    tokens = [m.tokens for _, m in whole]
    assert sum(map(len, tokens)) >= 10 and all(m.error is None for _, m in whole)
    prompt_ids = prompts[-1]
    for cut in range(1, len(whole) - 1):
        carried = [t for group in tokens[:cut] for t in group]
        if not carried:
            continue
        head = events(whole[0][0])[0]
        resumed = await marked_writes(h, path, resume_body(body, prompt_ids, carried, head))
        assert events(b"".join(w for w, _ in resumed)) == events(b"".join(w for w, _ in whole[cut:])), cut
        assert [t for _, m in resumed for t in m.tokens] == [t for group in tokens[cut:] for t in group]
    await h.client.wait_idle()  # a stop string aborts its request on the way out
    h.assert_engine_idle()


async def test_a_resume_leg_is_checked(harness):
    h = harness
    bad = {**CHAT, "max_tokens": 2}
    response = await h.http.post("/v1/chat/completions", json=resume_body(bad, [5, 6, 7], [8, 9]))
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    response = await h.http.post("/v1/chat/completions",
                                 json=resume_body({**CHAT, "stream": False}, [5, 6, 7], [8, 9]))
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream"
    response = await h.http.post("/v1/chat/completions",
                                 json={**CHAT, "disaggregated_params": {"request_type": "resume"}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "disaggregated_params"
    response = await h.http.post("/v1/chat/completions", json=resume_body(CHAT, [5, 6, 7], [10**9]))
    assert response.status_code == 400
