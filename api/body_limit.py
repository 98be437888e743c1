"""A request-body size limit for every HTTP server of the project (frontends and orchestrator).

``limit_body(receive, headers, max_bytes)`` returns the ``receive`` a route
should read its body through: a body whose ``Content-Length`` is over the limit
is refused at the first read, before a byte of it is buffered; a chunked body
is counted as it arrives and refused as soon as it passes the limit. Either way
the handler's ``await request.body()`` raises ``RequestTooLargeError`` (413),
which the app renders in the route's API shape like any other error, so memory
never holds more than ``max_bytes`` of one request (a 50 MB JSON body used to
cost the orchestrator gigabytes while it decoded and tokenized it).

With a valid ``Content-Length`` under the limit the server itself stops at that
length, so the common case costs one header scan and no wrapper.

``read_body(receive)`` is ``Request.body()`` for the generating routes, without
Starlette's stream generator and its ``aclosing``: one ``receive()`` for a body
that came whole (about 2.5 us a request of the ~3).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import RequestTooLargeError
from api.memory import large_body, release_memory_soon

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "limit_body", "read_body", "BodyLimitMiddleware"]

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024  # millions of tokens: above any context window served here


def limit_body(receive: Receive, headers: Iterable[tuple[bytes, bytes]], max_bytes: int,
               key: str | None = None) -> Receive:
    """``key``: the config key of this limit, named in the 413 (the caller's own, when it has one)."""
    where = f" ({key})" if key else ""
    declared: int | None = None
    for name, value in headers:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                declared = None  # the server answers a malformed length itself
            break
    if declared is not None:
        if declared <= max_bytes:
            return receive

        async def refuse() -> Message:
            raise RequestTooLargeError(
                f"the request body is {declared} bytes; this server accepts at most {max_bytes}{where}")

        return refuse
    received = 0

    async def counted() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > max_bytes:
                raise RequestTooLargeError(f"the request body exceeds {max_bytes} bytes, the most this server "
                                           f"accepts{where}")
        return message

    return counted


async def read_body(receive: Receive) -> bytes:
    """The whole request body, read as ``Request.body()`` reads it: ``ClientDisconnect`` when the
    client leaves first, the limit's ``RequestTooLargeError`` through a limited ``receive``."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.request":
            body = message.get("body", b"")
            if not message.get("more_body", False):
                return b"".join([*chunks, body]) if chunks else body
            if body:
                chunks.append(body)
        elif message["type"] == "http.disconnect":
            raise ClientDisconnect()


class BodyLimitMiddleware:
    """``limit_body`` as an ASGI layer, for apps without a middleware of their own (the orchestrator);
    after a large body it gives the memory back (``api.memory``)."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 path_limits: Mapping[str, tuple[int, str]] | None = None) -> None:
        """``path_limits``: path -> (its own limit, the config key to name in its 413), e.g. the
        orchestrator's file uploads."""
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        large = large_body(scope["headers"])
        max_bytes, key = self.path_limits.get(scope["path"], (self.max_bytes, None))
        try:
            await self.app(scope, limit_body(receive, scope["headers"], max_bytes, key), send)
        finally:
            if large:
                release_memory_soon()
