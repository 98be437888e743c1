"""The HTTP stack's limit for benchmarks/frontend_scaling.py: a fixed JSON body on uvicorn.

Same uvicorn settings as a frontend (api.server): uvloop, httptools, no
access log, an SO_REUSEPORT socket. ``raw`` is a bare ASGI callable;
``starlette`` sends the same body through one Starlette route; ``stream``
answers as a frontend streams a chat completion at zero engine cost (the
SSE headers, one frame with the role and all the content, one with the
finish reason and ``[DONE]``, the end): what streaming alone costs the
HTTP stack, with no tokenizer, template or engine.

    python benchmarks/bare_app.py raw|starlette|stream --port PORT
"""

from __future__ import annotations

import argparse
import asyncio
import signal

HOST = "127.0.0.1"
READY_LINE = "bare app: ready"

_BARE_BODY = b'{"id":"bare","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",' \
             b'"content":"ok"},"finish_reason":"stop"}]}'
_BARE_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(_BARE_BODY)).encode())]


_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_CHUNK = b'data: {"id":"bare","object":"chat.completion.chunk","created":0,"model":"bare","choices":[{"index":0,' \
         b'"delta":%s,"finish_reason":%s}]}\n\n'
_SSE_FRAMES = [_CHUNK % (b'{"role":"assistant","content":""}', b"null")
               + _CHUNK % (b'{"content":"' + b"tok " * 16 + b'"}', b"null"),
               _CHUNK % (b"{}", b'"length"') + b"data: [DONE]\n\n"]


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        await send({"type": message["type"] + ".complete"})
        if message["type"] == "lifespan.shutdown":
            return


async def _read_body(receive) -> None:
    more = True
    while more:
        more = (await receive()).get("more_body", False)


async def bare_app(scope, receive, send) -> None:
    """The HTTP stack's limit: read the body, answer a fixed JSON body."""
    if scope["type"] == "lifespan":
        return await _lifespan(receive, send)
    await _read_body(receive)
    await send({"type": "http.response.start", "status": 200, "headers": _BARE_HEADERS})
    await send({"type": "http.response.body", "body": _BARE_BODY})


async def stream_app(scope, receive, send) -> None:
    """Streaming's share of the HTTP stack: the frames a frontend sends for a zero-cost chat stream."""
    if scope["type"] == "lifespan":
        return await _lifespan(receive, send)
    await _read_body(receive)
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    for frame in _SSE_FRAMES:
        await send({"type": "http.response.body", "body": frame, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def starlette_bare_app():
    """The same fixed body through a Starlette route (routing, Request, Response objects)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def chat(request: Request) -> Response:
        await request.body()
        return Response(_BARE_BODY, media_type="application/json")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def serve_bare_app(kind: str, port: int) -> int:
    """The same uvicorn settings as a frontend (api.server): uvloop, httptools, SO_REUSEPORT."""
    import uvicorn

    from api.header_limit import h11_head_limit, http_protocol
    from api.server import QuietServer, make_listen_socket, run_event_loop

    async def main() -> int:
        app = {"raw": bare_app, "stream": stream_app}.get(kind) or starlette_bare_app()
        config = uvicorn.Config(app, log_level="warning", access_log=False, http=http_protocol(), lifespan="auto",
                                **h11_head_limit())
        server = QuietServer(config)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: setattr(server, "should_exit", True))
        serving = asyncio.create_task(server.serve(sockets=[make_listen_socket(HOST, port)]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        print(READY_LINE, flush=True)
        await serving
        return 0

    return run_event_loop(main())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("raw", "starlette", "stream"))
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    return serve_bare_app(args.kind, args.port)


if __name__ == "__main__":
    raise SystemExit(main())
