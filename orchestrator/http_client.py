"""The orchestrator's HTTP/1.1 client for its hot paths: asyncio protocols, httptools, keep-alive.

Every client request becomes one or two legs to workers, so the client's
cost is paid per request: httpx (httpcore, anyio, h11) spent ~1.5 ms of CPU
per leg in profiles, most of what the orchestrator added to a request. A leg
needs little: a POST to a known worker, the status, the body whole or as it
arrives, keep-alive, and a way to abort. This is that, on the event loop's
own transports and the C parser uvicorn uses (httptools); health checks and
other control calls stay on httpx.

Cancellation closes the connection: a worker sees the disconnect and aborts
the request in its engine. A connection is reused only after a complete
response that allows keep-alive, and not after ``IDLE_SECONDS`` unused (the
workers' uvicorn closes keep-alive connections after 5 s; reusing one it is
closing would fail a leg). A request that finds its reused connection closed
before any byte of the answer is sent again once on a fresh connection: the
worker never started it, and the stale connection is the pool's own doing.
That is the only repeat here: the transport raises every other failure
(``UpstreamUnreachable``: nothing accepts the connection; ``UpstreamLost``: a
fresh connection lost before any byte of the answer; ``UpstreamTimeout``), and
whether to try the same worker again (one of its K frontends died) or another
is ``orchestrator.attempts``' decision alone.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from functools import lru_cache
from urllib.parse import urlsplit

import httptools

from api.streaming import FinalFrame

__all__ = ["HttpClient", "LegResponse", "UpstreamError", "UpstreamLost", "UpstreamTimeout", "UpstreamUnreachable",
           "IDLE_SECONDS"]

IDLE_SECONDS = 4.0
MAX_IDLE_PER_ORIGIN = 512
# Body bytes buffered before reading from the worker pauses (a slow client of a fast stream).
MAX_BUFFERED = 1 << 20



class UpstreamError(ConnectionError):
    """No connection, a connection lost or an answer that is not HTTP/1.1."""


class _Unanswered(Exception):
    """Inside ``HttpClient.request``: the connection closed before any byte of the answer."""


class UpstreamUnreachable(UpstreamError):
    """Nothing accepts connections at the worker's address: the whole worker is gone (its K
    frontends share the port), unlike a connection lost mid-answer (one frontend)."""


class UpstreamLost(UpstreamError):
    """A fresh connection closed before any byte of the answer: the frontend process that took it
    may have died (its K - 1 siblings behind the same port may not have)."""


class UpstreamTimeout(UpstreamError):
    """The worker sent nothing for the client's ``idle_timeout``."""


@lru_cache(maxsize=1024)
def _origin(url: str) -> tuple[str, int, str]:
    """(host, port, path with query) of an ``http://`` URL."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"not an http:// URL: {url!r}")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.hostname, parts.port or 80, path


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one response at a time."""

    def __init__(self, origin: tuple[str, int]) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.closed = False
        self._response: LegResponse | None = None

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # create_connection's: a stream Transport

    def data_received(self, data: bytes) -> None:
        response = self._response
        if response is None:  # bytes nobody asked for: the connection is not usable
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"bad HTTP from {self.origin[0]}:{self.origin[1]}: {exc}"))
            self.close()
        if response._deliver is not None:  # relayed as it came: this read's bytes in one call
            response._push()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(UpstreamError(f"{self.origin[0]}:{self.origin[1]} closed the connection"
                                 + (f": {exc}" if exc else "")))

    # -- httptools callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._response is not None
        self._response.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        assert self._response is not None
        self._response._headers_complete(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        assert self._response is not None
        self._response._body(body)

    def on_message_complete(self) -> None:
        response, self._response = self._response, None
        assert response is not None
        response._complete(self.parser.should_keep_alive())

    # -- ours -------------------------------------------------------------------------------

    def start(self, response: LegResponse, request: bytes) -> None:
        self._response = response
        assert self.transport is not None
        self.transport.write(request)

    def _fail(self, exc: UpstreamError) -> None:
        response, self._response = self._response, None
        if response is not None:
            response._fail(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def set_reading(self, on: bool) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading() if on else self.transport.pause_reading()


class LegResponse:
    """A worker's answer: ``status`` and ``headers`` once ``HttpClient.post`` returns, then the body."""

    def __init__(self, client: HttpClient, connection: _Connection) -> None:
        self.status = 0
        self.idle_timeout = client.idle_timeout
        self.headers: list[tuple[bytes, bytes]] = []
        self._client = client
        self._connection = connection
        self._loop = asyncio.get_running_loop()
        self._head: asyncio.Future[None] = self._loop.create_future()
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False  # reading from the worker, paused while MAX_BUFFERED wait unread
        self._waiter: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None
        self._done = False
        self._keep_alive = False
        self._released = False
        self._deliver: Deliver | None = None  # push mode (``relay_to``)
        self._delivered_end = False
        self.received_any = False
        # One lazy timer per answer instead of an asyncio.timeout per wait (a streamed answer waits
        # once per event): it fires at most every idle_timeout and fails the wait only when nothing
        # arrived since the wait began for that long.
        self._waiting_since: float | None = None
        self._last_data = self._loop.time()
        self._timer = self._loop.call_at(self._last_data + self.idle_timeout, self._check_idle)

    # -- from the connection ----------------------------------------------------------------

    def _headers_complete(self, status: int) -> None:
        self.status = status
        self.received_any = True
        self._last_data = self._loop.time()
        if not self._head.done():
            self._head.set_result(None)

    def _body(self, body: bytes) -> None:
        self._last_data = self._loop.time()
        self._chunks.append(body)
        if self._deliver is not None:  # pushed once the read is parsed (``_Connection.data_received``)
            return
        self._buffered += len(body)
        if self._buffered > MAX_BUFFERED and not self._paused:
            self._paused = True
            self._connection.set_reading(False)
        self._wake()

    def _complete(self, keep_alive: bool) -> None:
        self._done, self._keep_alive = True, keep_alive
        self._timer.cancel()
        self._wake()

    def _fail(self, exc: UpstreamError) -> None:
        if self._error is None:  # the first cause stays (a timeout, then the close it caused)
            self._error = exc
        self._timer.cancel()
        if not self._head.done():
            self._head.set_exception(self._error)
        self._wake()
        if self._deliver is not None:
            self._push()

    def _push(self) -> None:
        """Push mode: what arrived since the last push, and the end if it came."""
        if self._delivered_end or self._deliver is None:
            return
        chunks = self._chunks
        data = (chunks[0] if len(chunks) == 1 else b"".join(chunks)) if chunks else b""
        chunks.clear()
        self._buffered = 0
        end = self._done or self._error is not None
        if data or end:
            self._delivered_end = end
            self._deliver(data, end, None if self._done else self._error)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _check_idle(self) -> None:
        if self._released:
            return
        now = self._loop.time()
        if self._waiting_since is None:  # nobody waits: look again one idle_timeout later
            self._timer = self._loop.call_at(now + self.idle_timeout, self._check_idle)
            return
        due = max(self._last_data, self._waiting_since) + self.idle_timeout
        if now < due:
            self._timer = self._loop.call_at(due, self._check_idle)
            return
        where = self._connection.origin
        self.expire(UpstreamTimeout(f"no answer from {where[0]}:{where[1]} for {self.idle_timeout:g} s"))

    def expire(self, exc: UpstreamError) -> None:
        """End the answer now with ``exc`` (a timeout): the connection closes, so the worker sees
        the disconnect and aborts; chunks already buffered are still read before ``exc`` is raised."""
        self._fail(exc)
        self._connection.close()

    # -- for the caller ---------------------------------------------------------------------

    async def _wait_head(self) -> None:
        await self._idle(self._head)

    async def _idle(self, future: asyncio.Future[None]) -> None:
        # Bounded by the lazy idle timer (``_check_idle``), which fails ``future`` with UpstreamTimeout.
        self._waiting_since = self._loop.time()
        try:
            await future
        finally:
            self._waiting_since = None

    def relay_to(self, deliver: Deliver) -> None:
        """Push mode, instead of ``chunks()``: from now on every read's body bytes go to
        ``deliver(data, end, error)`` from the connection's own callbacks (no buffering, no task
        wake-up per chunk), and the end (``error``: an ``UpstreamError`` that cut it) with them.
        The idle timeout counts from now; ``hold`` pauses it with the reading."""
        self._deliver = deliver
        self._waiting_since = self._loop.time()
        if self._paused:
            self._paused = False
            self._connection.set_reading(True)
        self._push()

    def hold(self, held: bool) -> None:
        """Push mode: stop (or resume) reading the worker while the client cannot take more."""
        self._waiting_since = None if held else self._loop.time()
        self._connection.set_reading(not held)

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        async for chunk in self.chunks():
            parts.append(chunk)
        return b"".join(parts)

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body as it arrives; raises ``UpstreamError`` if the connection fails before its end.
        The last chunk is a ``FinalFrame`` when the end came with it."""
        try:
            while True:
                if self._chunks:
                    if len(self._chunks) == 1:
                        chunk = self._chunks.popleft()
                    else:  # several arrived since the last read (a busy loop): relayed as one write
                        chunk = b"".join(self._chunks)
                        self._chunks.clear()
                    self._buffered -= len(chunk)
                    if self._done and not self._chunks:  # the answer's end came with it: one write
                        chunk = FinalFrame(chunk)
                    if self._paused and self._buffered <= MAX_BUFFERED // 2:
                        self._paused = False
                        self._connection.set_reading(True)
                    yield chunk
                    continue
                if self._done:
                    return
                if self._error is not None:
                    raise self._error
                self._waiter = self._loop.create_future()
                await self._idle(self._waiter)
        finally:
            self._waiter = None

    def close(self) -> None:
        """Done with the answer: a complete one frees its connection for reuse, anything else closes it."""
        if self._released:
            return
        self._released = True
        self._timer.cancel()
        if self._done and self._keep_alive and not self._chunks:
            self._client._release(self._connection)
        else:
            self._connection.close()


Deliver = Callable[[bytes, bool, "UpstreamError | None"], None]
"""``deliver(data, end, error)``: push mode's receiver (``LegResponse.relay_to``)."""


def _header_lines(headers: dict[str, str]) -> str:
    lines = []
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines)


class HttpClient:
    """Pooled keep-alive connections per origin (TCP, or one Unix socket for every URL: ``uds``)."""

    def __init__(self, connect_timeout: float, idle_timeout: float, uds: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        """``headers``: sent with every request (the worker key's ``authorization``)."""
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout  # the longest wait for the next byte of an answer
        self.uds = uds
        self._fixed_head = _header_lines(headers or {})
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> LegResponse:
        return await self.request("POST", url, body, headers)

    async def call(self, method: str, url: str, body: bytes = b"",
                   headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """(status, whole body) of a request; the connection goes back to the pool."""
        response = await self.request(method, url, body, headers)
        try:
            return response.status, await response.read()
        finally:
            response.close()

    async def request(self, method: str, url: str, body: bytes = b"",
                      headers: dict[str, str] | None = None) -> LegResponse:
        """Send a request; returns once the status and headers are in (the body follows).

        Raises ``UpstreamUnreachable`` (no connection within ``connect_timeout``), ``UpstreamLost``
        (a fresh connection lost before the answer), ``UpstreamTimeout`` (no answer within
        ``idle_timeout``), ``UpstreamError`` (anything else: lost mid-answer, not HTTP)."""
        host, port, path = _origin(url)
        head = (f"{method} {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-length: {len(body)}\r\n"
                f"{self._fixed_head}{_header_lines(headers) if headers else ''}")
        request = head.encode("latin-1") + b"\r\n" + body
        connection = self._take_idle((host, port))
        if connection is not None:
            try:
                return await self._send(connection, request)
            except _Unanswered:
                pass  # a stale keep-alive connection (the worker closed it idle): once more, fresh
        try:
            return await self._send(await self._connect(host, port), request)
        except _Unanswered as exc:
            raise UpstreamLost(str(exc.__cause__)) from exc.__cause__

    async def _send(self, connection: _Connection, request: bytes) -> LegResponse:
        """The answer's head on ``connection``; ``_Unanswered`` when it closed before any byte of it."""
        response = None
        try:
            response = LegResponse(self, connection)
            connection.start(response, request)
            await response._wait_head()
            return response
        except UpstreamError as exc:
            connection.close()
            if isinstance(exc, UpstreamTimeout) or (response is not None and response.received_any):
                raise  # a silent worker, or one that answered
            raise _Unanswered() from exc
        except BaseException:
            connection.close()  # cancelled: the worker sees the disconnect and aborts
            raise

    async def _connect(self, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        factory = functools.partial(_Connection, (host, port))
        connecting = (loop.create_unix_connection(factory, self.uds) if self.uds is not None
                      else loop.create_connection(factory, host, port))
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that
            # lands as the connect finishes, and a cancelled caller (a process shutting down) then
            # carried on (the state link's retry loop kept a process in its shutdown for ever).
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await connecting
        except TimeoutError as exc:
            where = self.uds if self.uds is not None else f"{host}:{port}"
            raise UpstreamTimeout(f"cannot connect to {where} within {self.connect_timeout:g} s") from exc
        except OSError as exc:
            where = self.uds if self.uds is not None else f"{host}:{port}"
            raise UpstreamUnreachable(f"cannot connect to {where}: {type(exc).__name__}: {exc}") from exc
        return connection

    def _take_idle(self, origin: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < IDLE_SECONDS:
                return connection
            connection.close()
        return None

    def _release(self, connection: _Connection) -> None:
        if connection.closed:
            return
        idle = self._idle.setdefault(connection.origin, [])
        if len(idle) >= MAX_IDLE_PER_ORIGIN:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
