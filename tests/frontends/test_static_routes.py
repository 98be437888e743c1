"""frontends.static_routes: the exact-path dict answers as Starlette's in-order scan does."""

from __future__ import annotations

import httpx
import pytest
from http_harness import worker_apps
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import BaseRoute, Match, Mount, Route, Router

from frontends.static_routes import StaticRouter, static_index


def _echo(name: str):
    async def endpoint(request: Request) -> PlainTextResponse:
        params = ",".join(f"{k}={v}" for k, v in sorted(request.path_params.items()))
        route = request.scope["route"].path
        return PlainTextResponse(f"{name} {route} [{params}] {request.scope['endpoint'] is endpoint}")
    return endpoint


class _CountingRoute(BaseRoute):
    """Matches nothing; counts how often the scan asked it."""

    def __init__(self) -> None:
        self.num_asked = 0

    def matches(self, scope):
        self.num_asked += 1
        return Match.NONE, {}


def _routes(spy: _CountingRoute) -> list[BaseRoute]:
    return [
        spy,
        Route("/v1/{rest:path}", _echo("catch-all-delete"), methods=["DELETE"]),  # PARTIAL for other methods
        Mount("/mounted", routes=[Route("/x", _echo("inside-mount"), methods=["GET"])]),
        Route("/mounted/x", _echo("shadowed-by-mount"), methods=["GET", "POST"]),
        Route("/v1/chat", _echo("chat"), methods=["POST"]),
        Route("/v1/chat", _echo("chat-get"), methods=["GET"]),  # a second route, another method
        Route("/v1/chat", _echo("chat-dup"), methods=["POST"]),  # never reached: the first wins
        Route("/items/{item_id:int}", _echo("item"), methods=["GET"]),
        Route("/health", _echo("health"), methods=["GET"]),
        Route("/anything", _echo("anything")),  # no methods given: GET and HEAD
    ]


REQUESTS = [(m, p) for p in ("/v1/chat", "/v1/chat/", "/mounted/x", "/items/3", "/items/x", "/health",
                             "/nope", "/v1/other", "/anything")
            for m in ("GET", "HEAD", "POST", "PUT", "DELETE")]


async def _answers(app) -> list[tuple]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", follow_redirects=False) as http:
        out = []
        for method, path in REQUESTS:
            response = await http.request(method, path)
            out.append((method, path, response.status_code, response.text, response.headers.get("allow"),
                        response.headers.get("location")))
        return out


@pytest.mark.asyncio
async def test_every_request_gets_what_the_scan_gives():
    plain = await _answers(Router(_routes(_CountingRoute())))
    static = await _answers(StaticRouter(Router(_routes(_CountingRoute()))))
    assert static == plain
    by_request = {(m, p): (status, text) for m, p, status, text, _, _ in plain}
    # The traps are live: each would answer differently if the dict ignored precedence.
    assert by_request[("GET", "/mounted/x")] == (200, "inside-mount /x [] True")
    assert by_request[("POST", "/mounted/x")][0] == 405  # the mount takes the path whatever the method
    assert by_request[("DELETE", "/v1/chat")][1].startswith("catch-all-delete")
    assert by_request[("POST", "/v1/chat")] == (200, "chat /v1/chat [] True")
    assert by_request[("HEAD", "/health")][0] == 200 and by_request[("PUT", "/health")][0] == 405


@pytest.mark.asyncio
async def test_indexed_requests_skip_the_scan_and_the_rest_take_it():
    spy = _CountingRoute()
    router = StaticRouter(Router(_routes(spy)))
    transport = httpx.ASGITransport(app=router)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        assert (await http.get("/health")).text == "health /health [] True"  # builds the index
        spy.num_asked = 0
        assert (await http.post("/v1/chat")).text == "chat /v1/chat [] True"
        assert (await http.get("/health")).status_code == 200
        assert spy.num_asked == 0
        assert (await http.get("/items/3")).text == "item /items/{item_id:int} [item_id=3] True"
        assert (await http.put("/health")).status_code == 405
        assert spy.num_asked == 2
        # Routes added after the first request are seen (the index is rebuilt).
        router.router.routes.insert(1, Route("/health", _echo("new-health"), methods=["GET"]))
        assert (await http.get("/health")).text == "new-health /health [] True"


def test_the_index_keeps_precedence():
    index = static_index(_routes(_CountingRoute()))
    assert sorted(index) == [("/anything", "GET"), ("/anything", "HEAD"), ("/health", "GET"), ("/health", "HEAD"),
                             ("/v1/chat", "GET"), ("/v1/chat", "HEAD"),
                             ("/v1/chat", "POST")]
    assert index[("/v1/chat", "POST")].path == "/v1/chat" and index[("/v1/chat", "POST")].methods == {"POST"}


@pytest.mark.parametrize("role", ["launcher", "attached"])
def test_the_worker_apps_index_their_inference_routes_and_not_the_launchers(tiny_model_dir, tokenizer, tmp_path,
                                                                             role):
    app = worker_apps(tiny_model_dir, tokenizer, tmp_path)[role]
    index = static_index(app.router.routes)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        assert index[(path, "POST")].path == path
    assert ("/v1/chat/completions", "GET") not in index  # a 405: the scan answers it
    # Launcher-owned exact paths are indexed to their handler (launcher) or forwarder (attached),
    # whichever comes first in the route list, as the scan would pick.
    first = next(r for r in app.router.routes if getattr(r, "path", None) == "/perf_metrics")
    assert index[("/perf_metrics", "GET")] is first
