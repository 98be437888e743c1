"""CleanEndsMiddleware on a real Starlette app: ends that happen outside any handler's own error
mapping still reach the client in the API's JSON shape, never uvicorn's plain-text 500.

(The shutdown cut, a cancellation, runs through real processes in test_orchestrator_processes.)
"""

from __future__ import annotations

import asyncio

import httpx
import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from orchestrator.clean_ends import CleanEndsMiddleware


async def _boom(request: Request) -> Response:
    raise RuntimeError("a bug")


async def _half_stream(request: Request) -> Response:
    async def frames():
        yield b'data: {"choices": []}\n\n'
        raise RuntimeError("the producer broke")

    return StreamingResponse(frames(), media_type="text/event-stream")


async def _short_stream(request: Request) -> Response:
    async def frames():
        yield b"event: message_start\ndata: {}\n\n"

    return _Unfinished(frames())


class _Unfinished(Response):
    """A producer that stops without the last body message (as a swallowed failure does)."""

    def __init__(self, frames) -> None:
        super().__init__(media_type="text/event-stream")
        self.frames = frames

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        async for frame in self.frames:
            await send({"type": "http.response.body", "body": frame, "more_body": True})


class _BrokenMiddleware:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/messages/broken":
            raise KeyError("middleware bug")
        await self.app(scope, receive, send)


def _app() -> Starlette:
    return Starlette(routes=[Route("/v1/completions", _boom, methods=["POST"]),
                             Route("/v1/messages", _short_stream, methods=["POST"]),
                             Route("/v1/chat/completions", _half_stream, methods=["POST"])],
                     middleware=[Middleware(CleanEndsMiddleware), Middleware(_BrokenMiddleware)])


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=_app(), raise_app_exceptions=False),
                             base_url="http://test")


def test_an_exception_out_of_a_handler_or_middleware_is_a_json_500():
    async def run():
        async with _client() as client:
            return (await client.post("/v1/completions", json={}),
                    await client.post("/v1/messages/broken", json={}))

    openai, anthropic = asyncio.run(run())
    assert openai.status_code == 500 and openai.headers["content-type"] == "application/json"
    assert openai.json()["error"]["type"] == "internal_error"
    assert anthropic.status_code == 500 and anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["type"] == "api_error"


def test_a_stream_cut_short_ends_with_the_api_error_event():
    async def run():
        async with _client() as client:
            return (await client.post("/v1/chat/completions", json={}), await client.post("/v1/messages", json={}))

    openai, anthropic = asyncio.run(run())
    frames = openai.text.split("\n\n")
    assert frames[0] == 'data: {"choices": []}' and frames[-2] == "data: [DONE]"
    assert msgspec.json.decode(frames[-3][6:])["error"]["type"] == "internal_error"
    last = anthropic.text.rstrip("\n").split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ")
    assert msgspec.json.decode(last.split("data: ", 1)[1])["error"]["type"] == "api_error"
