"""Middle SSE frames written straight to the transport (api.direct_body): the same bytes
as through uvicorn's send, nothing written while the transport is paused, a client that goes
away still aborts the request in the engine, and the connection serves the next request."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket

import pytest
import uvicorn
from http_harness import make_harness
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from api.direct_body import DirectBody, offer_direct_body
from api.header_limit import http_protocol

BODY = {"model": "tiny-test", "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 40, "stream": True, "ignore_eos": True, "temperature": 0,
        "stream_options": {"include_usage": True}}


class RecordingTransport:
    """What a server transport receives; ``on_write`` runs after each write (a test pauses there).
    (Keep-alive requests without ``expect: 100-continue``, never reading: uvicorn's cycle and flow
    control call nothing else on it.)"""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.paused_writes = 0
        self.flow: FlowControl | None = None
        self.cycle: RequestResponseCycle | None = None
        self.on_write = None

    def write(self, data: bytes) -> None:
        assert self.flow is not None
        self.paused_writes += self.flow.write_paused
        self.writes.append(bytes(data))
        if self.on_write is not None:
            self.on_write(len(self.writes))


async def serve_in_cycle(app, body: bytes, direct: bool, transport: RecordingTransport) -> RequestResponseCycle:
    """One request through uvicorn's real ``RequestResponseCycle`` over ``transport``, offering the
    direct body as ``api.header_limit``'s protocol does (or not)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    transport.flow = flow = FlowControl(transport)  # type: ignore[arg-type]
    cycle = RequestResponseCycle(scope, transport, flow, logging.getLogger("test"),  # type: ignore[arg-type]
                                 logging.getLogger("test.access"), False, [], asyncio.Event(), False, True,
                                 lambda: None)
    transport.cycle = cycle
    cycle.body, cycle.more_body = bytearray(body), False
    cycle.message_event.set()
    if direct:
        offer_direct_body(scope, cycle)
    await cycle.run_asgi(app)
    return cycle


def counting_direct_writes(monkeypatch) -> list[int]:
    """How many frames ``DirectBody`` took (wrapped, same behaviour)."""
    taken: list[int] = []
    write = DirectBody.write

    def counted(self, data: bytes) -> bool:
        took = write(self, data)
        taken.append(took)
        return took

    monkeypatch.setattr(DirectBody, "write", counted)
    return taken


def normalized(data: bytes) -> bytes:
    """A response's bytes with what differs between two answers to one request masked
    (same lengths: the chunk sizes stay comparable)."""
    data = re.sub(rb'"id":"chatcmpl-[0-9a-f]+"', lambda m: b"#" * len(m.group()), data)
    return re.sub(rb'"created":\d+', lambda m: b"#" * len(m.group()), data)


def dechunk(data: bytes) -> tuple[bytes, list[bytes]]:
    """The head and the chunks of a chunked response that ends exactly at its last chunk."""
    head, _, rest = data.partition(b"\r\n\r\n")
    chunks = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        chunk, crlf, rest = rest[:size], rest[size:size + 2], rest[size + 2:]
        assert crlf == b"\r\n", (size_line, chunk[-40:])
        if size == 0:
            assert rest == b""  # nothing after the end of the body
            return head, chunks
        chunks.append(chunk)


def content(chunks: list[bytes]) -> str:
    text = []
    for event in b"".join(chunks).decode().split("\n\n"):
        payload = event.removeprefix("data: ")
        if payload and payload != "[DONE]":
            text.extend(choice["delta"].get("content") or "" for choice in json.loads(payload)["choices"])
    return "".join(text)


@pytest.mark.asyncio
async def test_direct_frames_are_byte_exact(tiny_model_dir, tokenizer, monkeypatch):
    """Through the direct body and through uvicorn's send: the same bytes, write for write."""
    taken = counting_direct_writes(monkeypatch)
    body = json.dumps(BODY).encode()
    through_send, direct = RecordingTransport(), RecordingTransport()
    for transport in (through_send, direct):  # each on a fresh engine: the same cache hits (none)
        app, h = await make_harness(tiny_model_dir, tokenizer)
        try:
            assert (await serve_in_cycle(app, body, transport is direct, transport)).response_complete
        finally:
            await h.client.close()
        assert taken or transport is through_send
    assert [normalized(w) for w in direct.writes] == [normalized(w) for w in through_send.writes]
    assert len(direct.writes) > 20 and sum(taken) == len(direct.writes) - 2  # all but the head and the last
    head, chunks = dechunk(b"".join(direct.writes))
    assert head.startswith(b"HTTP/1.1 200 OK") and b"transfer-encoding: chunked" in head
    assert b"x-disagg-frontend: 7" in head
    assert chunks[-1].endswith(b"data: [DONE]\n\n") and len(tokenizer.encode(content(chunks))) >= 30
    h.assert_engine_idle()


@pytest.mark.asyncio
async def test_nothing_is_written_while_the_transport_is_paused(tiny_model_dir, tokenizer, monkeypatch):
    """Paused after the 4th write: the frames wait (neither written directly nor by send), then
    go out joined, in order, and the direct writes resume after them."""
    app, h = await make_harness(tiny_model_dir, tokenizer, decode_step_seconds=0.001)
    taken = counting_direct_writes(monkeypatch)
    body = json.dumps({**BODY, "max_tokens": 120}).encode()
    try:
        free = RecordingTransport()
        await serve_in_cycle(app, body, True, free)
        paused = RecordingTransport()
        loop = asyncio.get_running_loop()

        def pause_once(num_writes: int) -> None:
            if num_writes == 4:
                assert paused.flow is not None
                paused.flow.pause_writing()
                loop.call_later(0.03, paused.flow.resume_writing)  # ~20 of the 120 outputs arrive meanwhile

        paused.on_write = pause_once
        before = len(taken)
        assert (await serve_in_cycle(app, body, True, paused)).response_complete
    finally:
        await h.client.close()
    assert paused.paused_writes == 0
    assert False in taken[before:] and sum(taken[before:]) > 3  # declined while paused, direct again after
    assert len(paused.writes) < len(free.writes)  # the held frames went out joined
    free_head, free_chunks = dechunk(b"".join(free.writes))
    paused_head, paused_chunks = dechunk(b"".join(paused.writes))
    # The second request hits the first's prefix cache: its usage says so.
    cached = re.compile(rb'"cached_tokens":\d+')
    assert cached.sub(b"", normalized(b"".join(paused_chunks))) == cached.sub(b"", normalized(b"".join(free_chunks)))
    assert content(paused_chunks) == content(free_chunks) != ""
    h.assert_engine_idle()


@pytest.mark.asyncio
async def test_nothing_is_written_after_the_client_left(tiny_model_dir, tokenizer):
    """The connection lost after the 4th write (as uvicorn's ``connection_lost`` marks it): no
    frame more reaches the transport, and the request is aborted in the engine."""
    app, h = await make_harness(tiny_model_dir, tokenizer, decode_step_seconds=0.001)
    transport = RecordingTransport()

    def lose_connection(num_writes: int) -> None:
        if num_writes == 4:
            assert transport.cycle is not None
            transport.cycle.disconnected = True
            transport.cycle.message_event.set()

    transport.on_write = lose_connection
    try:
        cycle = await serve_in_cycle(app, json.dumps({**BODY, "max_tokens": 120}).encode(), True, transport)
        await h.client.wait_idle(timeout=1)
    finally:
        await h.client.close()
    assert len(transport.writes) == 4 and not cycle.response_complete
    assert h.client.num_aborts == 1
    h.assert_engine_idle()


class UpperCaseBodies:
    """A middleware of the app's own that rewrites every body frame."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        async def upper(message: dict) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": message.get("body", b"").upper()}
            await send(message)

        await self.app(scope, receive, upper)


@pytest.mark.asyncio
async def test_app_middleware_sees_every_frame(tiny_model_dir, tokenizer, monkeypatch):
    """With middleware of the app's own, the direct body is withdrawn: every frame passes it."""
    app, h = await make_harness(tiny_model_dir, tokenizer)
    app.add_middleware(UpperCaseBodies)
    taken = counting_direct_writes(monkeypatch)
    transport = RecordingTransport()
    try:
        assert (await serve_in_cycle(app, json.dumps(BODY).encode(), True, transport)).response_complete
    finally:
        await h.client.close()
    head, chunks = dechunk(b"".join(transport.writes))
    assert not taken and len(chunks) > 20 and all(chunk == chunk.upper() for chunk in chunks)


def raw_post(body: dict, host: str = "tiny") -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: %b\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (host.encode(), len(data), data))


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One chunked response, up to and including its ``0\\r\\n\\r\\n``."""
    data = await reader.readuntil(b"\r\n\r\n")
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line, 16)
        data += size_line + await reader.readexactly(size + 2)
        if size == 0:
            return data


@pytest.mark.asyncio
async def test_live_stream_direct_keep_alive_and_disconnect(tiny_model_dir, tokenizer, monkeypatch):
    """On a real uvicorn with the project's protocol: two streams back to back on one connection
    (the direct frames leave it reusable), then a client that leaves mid-stream aborts its request
    in the engine long before it would have finished."""
    app, h = await make_harness(tiny_model_dir, tokenizer, decode_step_seconds=0.005)
    taken = counting_direct_writes(monkeypatch)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", http=http_protocol()))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection(*sock.getsockname())
        middle_chunks = 0
        for _ in range(2):
            writer.write(raw_post({**BODY, "max_tokens": 12}))
            head, chunks = dechunk(await asyncio.wait_for(read_response(reader), 10))
            assert head.startswith(b"HTTP/1.1 200") and chunks[-1].endswith(b"data: [DONE]\n\n")
            middle_chunks += len(chunks) - 1
        assert sum(taken) == middle_chunks > 2 * 4  # every chunk but the last went out directly
        writer.close()

        reader, writer = await asyncio.open_connection(*sock.getsockname())
        writer.write(raw_post({**BODY, "max_tokens": 200}))  # 200 steps of 5 ms: a second
        await reader.readuntil(b"\r\n\r\n")
        for _ in range(4):
            await reader.readuntil(b"\n\n")
        aborts = h.client.num_aborts
        writer.transport.abort()  # the client goes away mid-stream
        await h.client.wait_idle(timeout=0.5)
        assert h.client.num_aborts == aborts + 1
        h.assert_engine_idle()
    finally:
        server.should_exit = True
        await task
        await h.client.close()
