"""Streams pushed from the engine client's reader (api.push_stream): the same bytes as
pulled, in order, when the transport pushes back; the pulled stream stays for wrappers."""

from __future__ import annotations

import asyncio
import json

import pytest
from http_harness import make_harness

BODY = {"model": "tiny-test", "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 24, "stream": True, "ignore_eos": True, "temperature": 0,
        "stream_options": {"include_usage": True}}


def scope_for(body: bytes, path: str = "/v1/chat/completions") -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}


async def call(app, body: bytes, hold_after: int | None = None, release: asyncio.Event | None = None
               ) -> list[dict]:
    """Call the app as an ASGI server would; the send of body message ``hold_after`` waits for
    ``release`` (a paused transport). Returns the messages sent."""
    sent: list[dict] = []
    request_sent = False
    never = asyncio.Event()

    async def receive() -> dict:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and hold_after is not None and release is not None:
            if sum(m["type"] == "http.response.body" for m in sent) == hold_after:
                await release.wait()
        sent.append(message)

    await app(scope_for(body), receive, send)
    return sent


def events(messages: list[dict]) -> list[str]:
    data = b"".join(m["body"] for m in messages if m["type"] == "http.response.body").decode()
    return [line for line in data.split("\n\n") if line]


def content(frames: list[str]) -> str:
    text = []
    for frame in frames:
        payload = frame.removeprefix("data: ")
        if payload == "[DONE]":
            continue
        for choice in json.loads(payload)["choices"]:
            text.append(choice["delta"].get("content") or "")
    return "".join(text)


@pytest.mark.asyncio
async def test_paused_transport_holds_frames_in_order(tiny_model_dir, tokenizer):
    app, h = await make_harness(tiny_model_dir, tokenizer, decode_step_seconds=0.001)
    body = json.dumps(BODY).encode()
    try:
        free = await call(app, body)
        release = asyncio.Event()
        held = asyncio.create_task(call(app, body, hold_after=2, release=release))
        await asyncio.sleep(0.05)  # the engine goes on: ~20 more outputs arrive while the send waits
        assert not held.done()
        release.set()
        paused = await held
    finally:
        await h.http.aclose()
        await h.client.close()
    # Held frames went out joined, so there are fewer writes, but the same events in the same order.
    assert len([m for m in paused if m["type"] == "http.response.body"]) < len(
        [m for m in free if m["type"] == "http.response.body"])
    free_events, paused_events = events(free), events(paused)
    assert paused_events[-1] == "data: [DONE]"
    assert content(paused_events) == content(free_events) and len(content(free_events)) > 0
    usage = [json.loads(e.removeprefix("data: "))["usage"] for e in paused_events[-2:-1]]
    assert usage[0]["completion_tokens"] == 24
    assert paused[-1]["more_body"] is False and all(m.get("more_body", True) for m in paused[1:-1])
    h.assert_engine_idle()


@pytest.mark.asyncio
async def test_streamed_routes_are_pushed_and_pullable(tiny_model_dir, tokenizer):
    """The routes answer with the pushed response; its ``events`` (the Responses API wraps them)
    are the same stream pulled."""
    app, h = await make_harness(tiny_model_dir, tokenizer)
    pushed: list[int] = []
    open_stream = h.client.open_stream

    def counting_open_stream(*args, **kwargs):
        pushed.append(1)
        return open_stream(*args, **kwargs)

    h.client.open_stream = counting_open_stream  # type: ignore[method-assign]
    try:
        for path, body in (("/v1/chat/completions", BODY),
                           ("/v1/completions", {"model": "tiny-test", "prompt": "Once", "max_tokens": 8,
                                                "stream": True, "ignore_eos": True}),
                           ("/v1/messages", {"model": "tiny-test", "max_tokens": 8, "stream": True,
                                             "messages": [{"role": "user", "content": "Hi"}]})):
            async with h.http.stream("POST", path, json=body) as response:
                assert response.status_code == 200
                text = (await response.aread()).decode()
            assert text.rstrip().endswith(("[DONE]", '{"type":"message_stop"}')), text[-200:]
        assert len(pushed) == 3
        response = await h.http.post("/v1/responses", json={"model": "tiny-test", "input": "Hi", "stream": True,
                                                             "max_output_tokens": 8})
        assert response.status_code == 200 and '"output_tokens":8' in response.text
        assert len(pushed) == 3  # the Responses API re-encodes the pulled stream
    finally:
        await h.http.aclose()
        await h.client.close()
