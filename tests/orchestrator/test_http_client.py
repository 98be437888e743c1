"""The orchestrator's leg client against real sockets: a scripted asyncio HTTP server."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator import http_client
from orchestrator.http_client import HttpClient, UpstreamError, UpstreamLost, UpstreamTimeout

pytestmark = pytest.mark.asyncio


class Server:
    """Reads one request at a time per connection and answers what ``script`` says."""

    def __init__(self, script) -> None:
        self.script = script  # async (request head, body, writer, connection number) -> keep connection?
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.closed = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                if not await self.script(head, body, writer, number):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.set()
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()


def answer(body: bytes, status: int = 200, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n%s\r\n%s" % (status, len(body), extra, body)


async def fetch(client: HttpClient, url: str, body: bytes = b"x", headers: dict | None = None) -> bytes:
    status, content = await client.call("POST", url, body, headers)
    assert status == 200
    return content


async def post_fails(script, error: type[Exception], match: str, idle_timeout: float = 2) -> str:
    """POST to a server answering as ``script`` says; the client must raise ``error``.
    The server's URL, which is gone once this returns."""
    async with Server(script) as url:
        client = HttpClient(connect_timeout=2, idle_timeout=idle_timeout)
        with pytest.raises(error, match=match):
            await client.post(url, b"x", {})
        client.close()
    return url


async def echo(head, body, writer, number) -> bool:
    writer.write(answer(b"echo:" + body))
    return True


async def test_posts_and_reuses_the_connection() -> None:
    server = Server(echo)
    async with server as url:
        client = HttpClient(connect_timeout=2, idle_timeout=2)
        for i in range(3):
            assert await fetch(client, url + "/v1/x?y=1", b"body%d" % i, {"x-request-id": "r1"}) == b"echo:body%d" % i
        assert server.connections == 1
        head = server.requests[0][0]
        assert head.startswith(b"POST /v1/x?y=1 HTTP/1.1\r\n") and b"x-request-id: r1\r\n" in head
        client.close()


async def test_streams_a_chunked_body_as_it_arrives() -> None:
    release = asyncio.Event()

    async def stream(head, body, writer, number) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n"
                     b"6\r\ndata 1\r\n")
        await release.wait()
        writer.write(b"6\r\ndata 2\r\n0\r\n\r\n")
        return True

    async with Server(stream) as url:
        client = HttpClient(connect_timeout=2, idle_timeout=2)
        response = await client.post(url, b"{}", {})
        assert (b"content-type", b"text/event-stream") in response.headers
        chunks = response.chunks()
        assert await chunks.__anext__() == b"data 1"  # before the rest exists
        release.set()
        assert [c async for c in chunks] == [b"data 2"]
        response.close()
        client.close()


async def test_a_stale_keep_alive_connection_is_replaced_once() -> None:
    async def once_then_close(head, body, writer, number) -> bool:
        writer.write(answer(b"ok%d" % number))
        return False  # the server closes after each answer, without saying so

    server = Server(once_then_close)
    async with server as url:
        client = HttpClient(connect_timeout=2, idle_timeout=2)
        for _ in range(3):
            await fetch(client, url)
            await asyncio.sleep(0.05)  # the close reaches the client...
        # ...and a connection found closed is never reused: three connections, no failure.
        assert server.connections == 3
        client.close()


async def test_idle_connections_expire(monkeypatch) -> None:
    monkeypatch.setattr(http_client, "IDLE_SECONDS", 0.05)
    server = Server(echo)
    async with server as url:
        client = HttpClient(connect_timeout=2, idle_timeout=2)
        for _ in range(2):
            await fetch(client, url)
            await asyncio.sleep(0.1)
        assert server.connections == 2
        client.close()


async def test_a_reused_connection_closed_before_any_answer_is_retried_fresh() -> None:
    async def drop_second(head, body, writer, number) -> bool:
        if body == b"second" and number == 1:
            return False  # closed without a byte of answer, as a keep-alive timeout does
        writer.write(answer(b"ok"))
        return True

    server = Server(drop_second)
    async with server as url:
        client = HttpClient(connect_timeout=2, idle_timeout=2)
        for body in (b"first", b"second"):
            assert await fetch(client, url, body) == b"ok"
        assert server.connections == 2
        client.close()


async def test_a_fresh_connection_closed_before_any_answer_raises_without_trying_again() -> None:
    """The transport raises; whether the same worker is tried again is ``orchestrator.attempts``'."""
    async def drop(head, body, writer, number) -> bool:
        return False

    server = Server(drop)
    async with server as url:
        client = HttpClient(connect_timeout=2, idle_timeout=2)
        with pytest.raises(UpstreamLost, match="closed the connection"):
            await client.post(url, b"x", {})
        assert server.connections == 1
        client.close()


async def test_cancelling_a_request_closes_its_connection() -> None:
    disconnected = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.read()  # b"" once the client closes (a worker aborts the request then)
        disconnected.set()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = HttpClient(connect_timeout=2, idle_timeout=30)
    task = asyncio.create_task(client.post(url, b"", {}))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(disconnected.wait(), 5)
    server.close()


async def test_unanswered_requests_time_out_and_errors_are_upstream_errors() -> None:
    async def silent(head, body, writer, number) -> bool:
        await asyncio.sleep(5)
        return False

    await post_fails(silent, UpstreamTimeout, "no answer", idle_timeout=0.2)

    async def garbage(head, body, writer, number) -> bool:
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        return True

    url = await post_fails(garbage, UpstreamError, "bad HTTP")
    with pytest.raises(UpstreamError, match="cannot connect"):
        await HttpClient(connect_timeout=2, idle_timeout=2).post(url, b"x", {})  # the server is gone


async def test_a_connection_lost_mid_body_fails_the_stream() -> None:
    async def half(head, body, writer, number) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()
        return False

    async with Server(half) as url:
        client = HttpClient(connect_timeout=2, idle_timeout=2)
        response = await client.post(url, b"x", {})
        with pytest.raises(UpstreamError, match="closed the connection"):
            await response.read()
        response.close()
        client.close()


async def test_header_values_with_line_breaks_are_refused() -> None:
    with pytest.raises(ValueError, match="line break"):
        await HttpClient(connect_timeout=2, idle_timeout=2).post("http://127.0.0.1:9/", b"", {"x": "a\r\nb: c"})


async def test_gets_over_a_unix_socket(tmp_path) -> None:
    server = Server(echo)
    path = str(tmp_path / "state.sock")
    unix = await asyncio.start_unix_server(server.handle, path)
    client = HttpClient(connect_timeout=2, idle_timeout=2, uds=path)
    for _ in range(2):
        assert await client.call("GET", "http://state/snapshot?after=3") == (200, b"echo:")
    assert server.connections == 1 and server.requests[0][0].startswith(b"GET /snapshot?after=3 HTTP/1.1\r\n")
    client.close()
    unix.close()


def chunked_head() -> bytes:
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def test_a_body_that_goes_silent_times_out_and_a_steady_trickle_does_not() -> None:
    """The idle timeout bounds each wait for the next byte, not the whole answer."""

    async def trickle_then_silence(head, body, writer, number) -> bool:
        writer.write(chunked_head())
        for i in range(6):  # 0.6 s of answer: longer than the 0.3 s idle timeout, never idle that long
            writer.write(chunk(b"%d" % i))
            await writer.drain()
            await asyncio.sleep(0.1)
        await asyncio.sleep(5)  # then silence
        return False

    async with Server(trickle_then_silence) as url:
        client = HttpClient(connect_timeout=2, idle_timeout=0.3)
        response = await client.post(url, b"x", {})
        received = []
        started = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamTimeout, match="no answer"):
            async for part in response.chunks():
                received.append(part)
        waited = asyncio.get_running_loop().time() - started
        response.close()
        client.close()
    assert b"".join(received) == b"012345"
    assert 0.8 <= waited < 2.0  # the trickle (0.6 s) plus one idle timeout (0.3 s), not more


async def test_expire_ends_an_answer_after_what_was_buffered_and_closes_the_connection() -> None:
    disconnected = asyncio.Event()

    async def endless(head, body, writer, number) -> bool:
        writer.write(chunked_head() + chunk(b"first"))
        try:
            while True:
                await asyncio.sleep(0.05)
                writer.write(chunk(b"more"))
                await writer.drain()
        except ConnectionError:
            disconnected.set()
        return False

    async with Server(endless) as url:
        client = HttpClient(connect_timeout=2, idle_timeout=5)
        response = await client.post(url, b"x", {})
        parts = response.chunks()
        assert await parts.__anext__() == b"first"
        response.expire(UpstreamTimeout("the request timed out"))
        with pytest.raises(UpstreamTimeout, match="the request timed out"):
            async for _ in parts:
                pass
        response.close()
        client.close()
        await asyncio.wait_for(disconnected.wait(), 5)  # the worker saw the disconnect


async def test_chunks_that_arrived_together_are_read_as_one_and_nothing_is_lost(monkeypatch) -> None:
    """A reader that falls behind gets what arrived meanwhile in one piece (one write to its client),
    in order; past MAX_BUFFERED unread the worker's connection stops being read, then resumes."""
    monkeypatch.setattr(http_client, "MAX_BUFFERED", 64 * 1024)
    parts = [b"%06d|" % i * 200 for i in range(100)]  # 100 chunks of 1.4 KB: 140 KB in all

    async def burst(head, body, writer, number) -> bool:
        writer.write(chunked_head())
        for part in parts:
            writer.write(chunk(part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    async with Server(burst) as url:
        client = HttpClient(connect_timeout=2, idle_timeout=5)
        response = await client.post(url, b"x", {})
        await asyncio.sleep(0.3)  # fall behind: the burst arrives (and pauses reading past 64 KB)
        received = [piece async for piece in response.chunks()]
        response.close()
        assert await fetch(client, url) == b"".join(parts)  # the connection was reusable after it
        client.close()
    assert b"".join(received) == b"".join(parts)
    assert len(received) < len(parts) / 4
