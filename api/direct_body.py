"""A streamed response's middle frames written straight to the connection (issue 17 item 1).

Through ASGI, each SSE event is a message dict, a coroutine of our middleware's
``send`` wrapper and one of uvicorn's ``send`` before its ``transport.write``.
Once the response head is out, a middle frame needs none of it: ``DirectBody``
frames it as uvicorn would (HTTP/1.1 chunked: ``<hex length>\\r\\n<data>\\r\\n``)
and writes it to the transport itself. It declines (the caller then goes
through ``send``, which handles each case as before) whenever uvicorn's
``send`` would do anything but that one write: the head is not out or the body
is not chunked (a HEAD request), the response is complete, the client left
(``send`` drops the frame), or the transport is paused (``send`` waits for it
to drain). The last frame always goes through ``send``: it completes the
response in uvicorn's bookkeeping (keep-alive, the next pipelined request,
``0\\r\\n\\r\\n``).

The bounded httptools protocol (``api.header_limit``) offers its request
cycle in the scope's extensions under ``DIRECT_BODY``; a server without it (h11,
a test's ASGI transport) offers nothing, and every frame goes through ``send``.
The cycle is uvicorn 0.54's ``RequestResponseCycle`` (pinned in pyproject): its
``transport``, ``flow``, ``chunked_encoding``, ``response_complete`` and
``disconnected``.
"""

from __future__ import annotations

from typing import Any

from starlette.types import Scope

__all__ = ["DIRECT_BODY", "DirectBody", "offer_direct_body"]

DIRECT_BODY = "disagg.direct_body"


def offer_direct_body(scope: Any, cycle: Any) -> None:  # Any: uvicorn's HTTPScope TypedDict has no such key
    """What the server protocol calls once it has made the request's cycle."""
    extensions = scope.get("extensions")
    if extensions is None:
        scope["extensions"] = {DIRECT_BODY: cycle}
    else:
        extensions[DIRECT_BODY] = cycle


class DirectBody:
    """Writes the middle frames of one response's chunked body to its transport."""

    __slots__ = ("_cycle", "_transport", "_flow")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._transport = cycle.transport
        self._flow = cycle.flow

    @classmethod
    def of(cls, scope: Scope) -> DirectBody | None:
        """The scope's direct body, or None where the server offers none."""
        extensions = scope.get("extensions")
        cycle = None if extensions is None else extensions.get(DIRECT_BODY)
        return None if cycle is None else cls(cycle)

    def write(self, data: bytes) -> bool:
        """Write ``data`` (not the body's last bytes) now, or return False: ``send`` must take it."""
        cycle = self._cycle
        # chunked_encoding is None until the head is out, False for a sized (or HEAD) body.
        if self._flow.write_paused or cycle.disconnected or cycle.chunked_encoding is not True \
                or cycle.response_complete:
            return False
        if data:  # an empty chunk would end the body
            self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True
