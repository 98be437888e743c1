"""A bound on a request's head (request line and headers) for every HTTP server of the project.

uvicorn's httptools protocol buffers a request head without limit (h11 has
``h11_max_incomplete_event_size``), so a client could make a frontend or the
orchestrator hold megabytes of headers per connection. ``BoundedHttpToolsProtocol``
counts the head as it arrives, both the parsed pieces and the raw bytes of a
head not yet complete (one endless header line), and answers a head over
``MAX_HEAD_BYTES`` with 431 in the OpenAI or Anthropic error shape (by path), then
closes the connection. It also offers each request's cycle to the app for the
body frames written straight to the transport (``api.direct_body``).
``http_protocol()`` is what ``uvicorn.Config(http=...)`` takes, with h11 and its
own limit where httptools is not installed.
"""

from __future__ import annotations

from typing import Any

from api.direct_body import offer_direct_body
from api.errors import FrontendError, anthropic_error_body, http_error, openai_error_body

__all__ = ["MAX_HEAD_BYTES", "RequestHeadTooLargeError", "http_protocol", "h11_head_limit"]

MAX_HEAD_BYTES = 64 * 1024  # browsers and SDKs send a few KB; nginx's default is 32 KB


class RequestHeadTooLargeError(FrontendError):
    status = 431
    code = "request_header_fields_too_large"


def h11_head_limit() -> dict[str, Any]:
    """The ``uvicorn.Config`` keyword that bounds h11's buffered head the same way."""
    return {"h11_max_incomplete_event_size": MAX_HEAD_BYTES}


def http_protocol() -> Any:
    """``uvicorn.Config``'s ``http``: the bounded httptools protocol, or ``"h11"`` without httptools."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "h11"

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        _in_head = True
        _head_bytes = 0  # of the request being parsed, until its headers are complete
        _raw_head_bytes = 0
        _refused = False

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._in_head:
                self._raw_head_bytes += len(data)
            super().data_received(data)
            # Still in the head after this chunk: a head that never ends is refused as it grows.
            if self._in_head and self._raw_head_bytes > MAX_HEAD_BYTES and not self._refused:
                self._refuse()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes = True, 0

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            self._count(len(url))

        def on_header(self, name: bytes, value: bytes) -> None:
            super().on_header(name, value)
            self._count(len(name) + len(value) + 4)

        def on_headers_complete(self) -> None:
            self._in_head, self._raw_head_bytes = False, 0
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.scope is self.scope:  # None or an older one: an upgrade
                offer_direct_body(self.scope, cycle)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head = True

        def _count(self, num_bytes: int) -> None:
            self._head_bytes += num_bytes
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse()

        def _refuse(self) -> None:
            self._refused = True
            error = http_error(RequestHeadTooLargeError(
                f"the request line and headers exceed {MAX_HEAD_BYTES} bytes, the most this server accepts"))
            body = anthropic_error_body(error) if self.url.startswith(b"/v1/messages") else openai_error_body(error)
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return BoundedHttpToolsProtocol
