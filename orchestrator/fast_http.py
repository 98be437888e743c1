"""The fast lane: the generation routes served on uvicorn's connection protocol without ASGI.

Profiles of a proxied request put a quarter of the orchestrator's CPU in the
ASGI stack around the flow (Starlette's router, four middlewares, a Request
object, a task watching for the disconnect, and per SSE event a message dict
through three send wrappers). ``POST /v1/completions``,
``/v1/chat/completions`` and ``/v1/messages`` (exact paths, no query) skip
all of it: ``fast_http_protocol(orch)`` is uvicorn's httptools protocol (with
the head limit of ``api.header_limit``) whose parser hands those
requests to a ``FastCycle``; every other request (another method, path or
query, docs, errors) goes to the ASGI app as before. The cycle keeps
uvicorn's per-connection contract (``response_complete``, ``keep_alive``,
``on_response``, its task in ``server_state.tasks``), so pipelining, the
keep-alive timer and the graceful drain stay uvicorn's.

What a request gets here is what the ASGI routes give it, in the same order:
the admission gate (429 with Retry-After, before the body is read), the API
key (401), the body limit (413 on a Content-Length over it before reading, or
as a chunked body passes it), then ``Orchestrator.generate`` and its errors in
the API's shape (``orchestrator.app.error_parts``); a client that leaves
cancels the request's task, which closes the worker leg (the worker aborts);
an end outside the handler is JSON or the stream's error event as
``orchestrator.clean_ends`` writes them. Responses go to the transport as
bytes: one write for a JSON answer, and for a stream the head with the first
event and the last event with the chunked terminator.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from api.errors import ApiError, RequestTooLargeError, anthropic_error_body, openai_error_body
from api.header_limit import http_protocol
from api.memory import large_body, release_memory_soon
from api.streaming import ClientDisconnected, FinalFrame
from common.log_format import REQUEST_ID
from orchestrator.answers import JsonAnswer, StreamAnswer
from orchestrator.clean_ends import INTERNAL_ERROR, SHUTTING_DOWN, STREAM_CUT, stream_error_frame

if TYPE_CHECKING:
    from orchestrator.app import Orchestrator
    from orchestrator.relay import Relay

T = TypeVar("T")

__all__ = ["fast_http_protocol", "FAST_PATHS"]

log = logging.getLogger("disagg.orchestrator")

FAST_PATHS = {b"/v1/completions": "completions", b"/v1/chat/completions": "chat", b"/v1/messages": "messages"}

_SSE_HEAD = (b"content-type: text/event-stream; charset=utf-8\r\ncache-control: no-cache\r\n"
             b"x-accel-buffering: no\r\ntransfer-encoding: chunked\r\n")
_END = b"0\r\n\r\n"


def fast_http_protocol(orch: Orchestrator) -> Any:
    """``uvicorn.Config``'s ``http``: the fast lane for ``orch``'s generation routes (plain
    ``http_protocol()`` where httptools is missing)."""
    base = http_protocol()
    if isinstance(base, str):
        return base
    lane = _Lane(orch)

    class FastLaneProtocol(base):  # type: ignore[misc, valid-type]
        def on_headers_complete(self) -> None:
            api = FAST_PATHS.get(self.url)
            if api is None or self.parser.get_method() != b"POST" or self.parser.should_upgrade():
                super().on_headers_complete()
                return
            # What BoundedHttpToolsProtocol.on_headers_complete (not called here) does: the head is
            # over, so the body's bytes do not count against the head limit.
            self._in_head, self._raw_head_bytes = False, 0
            keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
            cycle = FastCycle(self, lane, api, keep_alive)
            previous = self.cycle  # type: ignore[has-type]  # uvicorn's, typed on a base mypy cannot see
            self.cycle = cycle
            if previous is None or previous.response_complete:
                self._start_asgi_task(cycle, None)
            else:  # pipelined behind a response still going out: uvicorn starts it after that one
                self.flow.pause_reading()
                self.pipeline.appendleft((cycle, None))

        def connection_lost(self, exc: Exception | None) -> None:
            cycle = self.cycle
            super().connection_lost(exc)
            # The request running (``self.cycle`` is the last parsed: a pipelined one may be queued).
            for each in {cycle, self.fast_running}:
                if isinstance(each, FastCycle):
                    each.client_left()

        def resume_writing(self) -> None:
            super().resume_writing()
            if self.fast_running is not None:
                self.fast_running.writable()

        fast_running: FastCycle | None = None

    return FastLaneProtocol


class _Lane:
    """What every fast request reads: the orchestrator, its admission gate and limits."""

    def __init__(self, orch: Orchestrator) -> None:
        config = orch.config
        self.orch = orch
        self.gate = orch.admission  # the app's too: one count of the process's requests in flight
        self.max_bytes = config.max_request_bytes
        self.api_key = orch.api_key  # the app's check (api.api_key)


class _BodyEvent:
    """The ``message_event`` uvicorn's protocol sets as body bytes (or the end) arrive: a future
    only while the cycle waits for more, nothing per request when the body came with the head."""

    __slots__ = ("_waiter",)

    def __init__(self) -> None:
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


class FastCycle:
    """One request on the fast lane; the attributes uvicorn's protocol reads and writes are
    those of its ``RequestResponseCycle``."""

    def __init__(self, protocol: Any, lane: _Lane, api: str, keep_alive: bool) -> None:
        self.protocol = protocol
        self.transport: asyncio.Transport = protocol.transport
        self.lane = lane
        self.api = api
        self.headers: list[tuple[bytes, bytes]] = protocol.headers
        self.expect_100_continue = protocol.expect_100_continue
        self.keep_alive = keep_alive
        self.on_response = protocol.on_response_complete
        # Set by the protocol as the body arrives (``on_body``, ``on_message_complete``).
        self.body = bytearray()
        self.more_body = True
        self.message_event = _BodyEvent()
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self._task: asyncio.Task[None] | None = None
        self._watching = False  # the task may be cancelled when the client leaves
        self._declared: int | None = None  # the Content-Length
        self._relay: Relay | None = None  # while a stream is relayed
        self._left = False

    # -- from the protocol --------------------------------------------------------------------

    def client_left(self) -> None:
        if self.response_complete:
            return
        self.disconnected = True
        if self._watching and not self._left and self._task is not None:
            self._left = True
            self._task.cancel()

    async def run_asgi(self, app: object) -> None:
        """The request's task (the name is uvicorn's: its protocol starts every cycle so)."""
        self._task = asyncio.current_task()
        self.protocol.fast_running = self
        gate = self.lane.gate
        admitted = gate.limit is None or gate.try_admit()
        large = large_body(self.headers)
        try:
            if not admitted:
                self._error(gate.refusal())
            else:
                await self._serve()
        except asyncio.CancelledError:
            if self._gone():
                return
            self._end(SHUTTING_DOWN)  # the drain ran out: the client still gets the API's shape
            raise
        except Exception as exc:  # a bug below the handler: logged, and JSON or an error event
            log.error("POST %s failed outside its handler", self.protocol.url.decode(), exc_info=exc)
            self._end(INTERNAL_ERROR)
        finally:
            if admitted and gate.limit is not None:
                gate.release()
            if self.protocol.fast_running is self:
                self.protocol.fast_running = None
            self.on_response = _nothing
            if large:
                release_memory_soon()

    def _gone(self) -> bool:
        """In an ``except CancelledError``: whether it was the client's leaving (consumed), not a shutdown."""
        return self._left and self._task is not None and self._task.uncancel() == 0

    # -- the request --------------------------------------------------------------------------

    async def _serve(self) -> None:
        request_id = session = traceparent = None
        x_api_key = authorization = None
        for name, value in self.headers:
            if name == b"content-length":
                self._declared = int(value) if value.isdigit() else None
            elif name == b"x-request-id" and request_id is None:
                request_id = value.decode("latin-1")
            elif name == b"x-session-id" and session is None:
                session = value.decode("latin-1")
            elif name == b"traceparent" and traceparent is None:
                traceparent = value.decode("latin-1")
            elif name == b"x-api-key" and x_api_key is None:
                x_api_key = value
            elif name == b"authorization" and authorization is None:
                authorization = value
        self._watching = True
        try:
            key = self.lane.api_key
            if key is not None and not key.accepts(x_api_key, authorization):
                raise key.refusal("a valid API key")
            answer = await self.lane.orch.generate(self.api, self._read_body, request_id or None, session or None,
                                                   self._watch, traceparent)
        except ClientDisconnected:
            return
        except asyncio.CancelledError:
            if self._gone():
                return
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is the API's error answer
            self._error(exc)
            return
        finally:
            self._watching = False
        if isinstance(answer, JsonAnswer):
            self._write_json(200, answer.body, answer.headers)
        else:
            await self._stream(answer)

    async def _read_body(self) -> bytes:
        """The body (``api.body_limit``'s rule: a Content-Length over the limit is refused
        before a byte is read, a chunked body as it passes the limit)."""
        limit = self.lane.max_bytes
        if self._declared is not None and self._declared > limit:
            raise RequestTooLargeError(f"the request body is {self._declared} bytes; this server accepts at "
                                       f"most {limit}")
        if self.more_body and self.expect_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while self.more_body and not self.disconnected:
            if len(self.body) > limit:
                break
            self.protocol.flow.resume_reading()  # paused by the protocol past 64 KiB buffered
            await self.message_event.wait()
        if len(self.body) > limit:
            raise RequestTooLargeError(f"the request body exceeds {limit} bytes, the most this server accepts")
        if self.disconnected:
            raise ClientDisconnected()
        body, self.body = bytes(self.body), bytearray()  # the protocol keeps the cycle until the next request
        return body

    async def _watch(self, work: Awaitable[T]) -> T:
        """``orchestrator.answers.Watch``: the client's leaving cancels this task (``client_left``)."""
        try:
            return await work
        except asyncio.CancelledError:
            if self._gone():
                raise ClientDisconnected() from None
            raise

    # -- the response -------------------------------------------------------------------------

    def _head(self, status: int, headers: dict[str, str], fixed: bytes) -> list[bytes]:
        self.response_started = True
        protocol = self.protocol
        if protocol.access_log and REQUEST_ID.get() is None:  # refused before the flow: no line at its end
            protocol.access_logger.info('%s - "%s %s HTTP/%s" %d', f"{protocol.client[0]}:{protocol.client[1]}"
                                        if protocol.client else "-", "POST", protocol.url.decode(), "1.1", status)
        head = [_status_line(status)]
        for name, value in protocol.server_state.default_headers:  # server, date: as uvicorn writes them
            head += (name, b": ", value, b"\r\n")
        head.append(fixed)
        for name, text in headers.items():
            if "\r" in text or "\n" in text:  # an echoed x-request-id never splits the head
                continue
            head.append(f"{name}: {text}\r\n".encode("latin-1", "replace"))
        if not self.keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        return head

    def _write_json(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        head = self._head(status, headers, b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
        head.append(body)
        self.transport.write(b"".join(head))
        self._complete()

    def _error(self, exc: BaseException) -> None:
        from orchestrator.app import error_parts  # app imports this module's users; not at import time

        status, body, headers = error_parts(exc, self.api == "messages")
        if status == 500:
            log.error("POST %s failed", self.protocol.url.decode(), exc_info=exc)
        self._write_json(status, body, headers)

    async def _stream(self, answer: StreamAnswer) -> None:
        relay = answer.relay
        first = relay.first_chunk
        head = self._head(200, answer.headers, _SSE_HEAD)
        head.append(b"%x\r\n%b\r\n" % (len(first), first) if first else b"")
        if type(first) is FinalFrame:  # the whole answer came at once
            head.append(_END)
            self.transport.write(b"".join(head))
            relay.close()
            self._complete()
            return
        self.transport.write(b"".join(head))
        self._relay = relay
        self._watching = True
        try:
            await relay.pipe(self._send)  # the rest, from the worker connection's callbacks
        except asyncio.CancelledError:
            if self._gone():
                return
            self._end_stream(relay.last, SHUTTING_DOWN)
            raise
        except Exception as exc:  # the status line is out: an error event ends the stream
            log.error("event stream failed", exc_info=exc)
            self._end_stream(relay.last, STREAM_CUT)
            return
        finally:
            self._watching = False
            self._relay = None
        self._complete()  # ``_send`` wrote the end

    def _send(self, data: bytes, end: bool) -> None:
        """``orchestrator.relay.Sink``: called by the worker connection's protocol."""
        if self.transport.is_closing():  # the client left: its task is being cancelled
            return
        frame = b"%x\r\n%b\r\n" % (len(data), data) if data else b""
        self.transport.write(frame + _END if end else frame)
        if not end and self.protocol.flow.write_paused and self._relay is not None:
            self._relay.upstream.hold(True)  # a slow client: stop reading the worker (``writable``)

    def writable(self) -> None:
        """The client's transport takes writes again."""
        if self._relay is not None:
            self._relay.upstream.hold(False)

    def _end_stream(self, last: bytes, error: ApiError) -> None:
        if self.transport.is_closing():
            return
        frame = (b"" if last.endswith(b"\n\n") else b"\n\n") + stream_error_frame(self.api == "messages", error)
        self.transport.write(b"%x\r\n%b\r\n%b" % (len(frame), frame, _END))
        self._complete()

    def _end(self, error: ApiError) -> None:
        """An end outside the handler: JSON before the head went out; else nothing more to say."""
        if self.response_complete or self.transport.is_closing():
            return
        if not self.response_started:
            anthropic = self.api == "messages"
            body = anthropic_error_body(error) if anthropic else openai_error_body(error)
            self._write_json(error.status_for(anthropic), body, error.headers())
        else:
            self.transport.close()

    def _complete(self) -> None:
        self.response_complete = True
        self.body = bytearray()  # a body refused unread (401, 413, 429) is not kept either
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.on_response()


def _nothing() -> None:
    pass


_STATUS_LINES: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        from uvicorn.protocols.http.httptools_impl import STATUS_LINE

        line = _STATUS_LINES[status] = STATUS_LINE.get(status, b"HTTP/1.1 %d \r\n" % status)
    return line

