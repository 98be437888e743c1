"""What the flow answers a client request with, before any server framework sees it.

``Flow.answer`` returns a ``JsonAnswer`` (a whole body) or a ``StreamAnswer``
(a streamed leg's ``orchestrator.relay.Relay``); ``to_response`` makes a Starlette response of
either for the ASGI routes, while the fast lane (``orchestrator.fast_http``)
writes them to the client's transport itself. A ``Watch`` runs the flow's
waits so that a client who leaves cancels them: ``disconnect_watch(receive)``
on ASGI, the fast lane's own cancellation there, ``unwatched`` for a request
with no client (a batch).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol, TypeVar

from starlette.responses import Response
from starlette.types import Receive

from api.streaming import EventStreamResponse, run_until_disconnect

if TYPE_CHECKING:
    from orchestrator.relay import Relay

__all__ = ["JsonAnswer", "StreamAnswer", "Answer", "Watch", "to_response", "disconnect_watch", "unwatched"]

T = TypeVar("T")

class Watch(Protocol):
    """``await watch(work)``: ``work``, raising ``ClientDisconnected`` when the client leaves meanwhile."""

    def __call__(self, work: Awaitable[T], /) -> Awaitable[T]: ...


class JsonAnswer:
    __slots__ = ("body", "headers")

    def __init__(self, body: bytes, headers: dict[str, str]) -> None:
        self.body = body
        self.headers = headers


class StreamAnswer:
    __slots__ = ("relay", "headers")

    def __init__(self, relay: Relay, headers: dict[str, str]) -> None:
        self.relay = relay  # drained once: ``relay.frames()`` or ``relay.pipe(sink)``
        self.headers = headers


Answer = JsonAnswer | StreamAnswer


def to_response(answer: Answer) -> Response:
    if isinstance(answer, JsonAnswer):
        return Response(answer.body, media_type="application/json", headers=answer.headers)
    response = EventStreamResponse(answer.relay.frames())
    response.raw_headers += [(k.encode(), v.encode()) for k, v in answer.headers.items()]
    return response


def disconnect_watch(receive: Receive) -> Watch:
    def watch(work: Awaitable[T]) -> Awaitable[T]:
        return run_until_disconnect(receive, work)

    return watch


def unwatched(work: Awaitable[T]) -> Awaitable[T]:
    return work
