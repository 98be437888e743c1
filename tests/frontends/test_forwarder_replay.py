"""What an attached frontend's forwarder replays, byte for byte, streaming included.

The attached app is the production one (``make_attached_app``); on the other
end of the admin socket sits a real uvicorn that echoes what it received, in
several chunks and gzip-encoded, so the test sees exactly what crossed.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import socket

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from api.serving import FrontendConfig
from frontends.worker_app import make_attached_app
from workers.attach import AttachInfo
from workers.protocol import EngineInfo


async def echo(request: Request) -> StreamingResponse:
    seen = {"method": request.method, "path": request.url.path, "query": request.url.query,
            "headers": dict(request.headers), "body": (await request.body()).decode()}
    payload = gzip.compress(json.dumps(seen).encode())

    async def chunks():
        for i in range(0, len(payload), 16):
            yield payload[i:i + 16]
            await asyncio.sleep(0.001)

    return StreamingResponse(chunks(), media_type="application/json",
                             headers={"content-encoding": "gzip", "x-launcher": "yes", "x-disagg-frontend": "0"})


class NoClient:
    on_request_done = None


@pytest.mark.asyncio
async def test_requests_are_replayed_verbatim_and_answers_streamed_back(tiny_model_dir, tokenizer, tmp_path):
    engine = EngineInfo("synthetic", 256, 512, [2], 16, 64)
    attach = AttachInfo(str(tmp_path), "00" * 32, 2, 3, os.getpid(), os.getpid(), engine, "127.0.0.1", 1)
    launcher = Starlette(routes=[Route("/{path:path}", echo, methods=["GET", "POST", "DELETE"])])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(attach.paths.launcher_admin))
    server = uvicorn.Server(uvicorn.Config(launcher, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    app = make_attached_app(NoClient(), tokenizer, FrontendConfig.for_model_dir(tiny_model_dir, frontend_id=2), attach)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://f") as http:
            response = await http.post(
                "/v1/messages/batches/msgbatch_01/cancel?x=1&y=%20z", content=b'{"a": [1, 2]}',
                headers={"content-type": "application/json", "authorization": "Bearer k", "x-api-key": "ak",
                         "anthropic-version": "2023-06-01", "accept": "application/json",
                         "cookie": "secret", "x-other": "dropped"})
            kv = await http.get("/kv_cache_events", params={"since": "3"})
    finally:
        server.should_exit = True
        await task
        await app.state.forwarder.aclose()
    assert response.status_code == 200
    assert response.headers["content-encoding"] == "gzip" and response.headers["x-launcher"] == "yes"
    assert response.headers.get_list("x-disagg-frontend") == ["2"]  # ours; the launcher's "0" is not relayed
    seen = response.json()  # httpx decoded the gzip that crossed untouched
    assert (seen["method"], seen["path"], seen["query"], seen["body"]) == (
        "POST", "/v1/messages/batches/msgbatch_01/cancel", "x=1&y=%20z", '{"a": [1, 2]}')
    headers = seen["headers"]
    assert {k: headers[k] for k in ("content-type", "authorization", "x-api-key", "anthropic-version", "accept")} == {
        "content-type": "application/json", "authorization": "Bearer k", "x-api-key": "ak",
        "anthropic-version": "2023-06-01", "accept": "application/json"}
    assert headers["x-disagg-forwarded-by"] == "2"
    assert "cookie" not in headers and "x-other" not in headers
    assert kv.json()["path"] == "/kv_cache_events" and kv.json()["query"] == "since=3"
    assert app.state.forwarder.num_forwarded == 2
