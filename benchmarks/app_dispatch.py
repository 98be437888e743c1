"""The per-request cost of serving the worker's and orchestrator's routes from FastAPI apps.

Both apps are ``DocumentedApp``s (``api.openapi``): FastAPI for ``/openapi.json`` and ``/docs``,
Starlette's path for every request. This measures, in one process and one run,
the CPU per request of the same routes and handlers (the real apps of
``frontends.app.build_app`` over an in-process synthetic engine and of
``orchestrator.app.build_app`` with no worker) dispatched three ways, driven by
raw ASGI calls (no sockets: the app layer alone, where the three differ):

  - ``documented``: the app as served;
  - ``starlette``: a plain Starlette app with the same routes and middleware
    (what the frontends served before they were FastAPI apps): the baseline;
  - ``fastapi``: the same FastAPI app on FastAPI's own request path (its
    ``__call__``, middleware stack and router), for scale: what was avoided.

Worker requests: ``GET /health`` (the cheapest route: dispatch dominates), ``GET
/nowhere`` (a 404 in the API's shape) and a streamed ``POST /v1/chat/completions``
of 8 tokens (the hot route; the in-process engine's CPU is in its figure too).
Orchestrator requests (no leg: no worker behind it): ``GET /health`` (503),
``GET /nowhere`` and ``POST /v1/messages/count_tokens`` (tokenized there). Each
round runs the three apps in turn, the first one rotating; the figure is the
median over rounds of process CPU seconds per request.

Target (PASS/FAIL): ``documented`` within 5% of ``starlette`` on every request kind.

    python benchmarks/app_dispatch.py [--requests 2000] [--rounds 9] [--out benchmarks/results/app_dispatch.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "frontends"))

from fastapi import FastAPI
from inproc_engine import InprocEngineClient, make_synthetic_core
from starlette.applications import Starlette
from starlette.exceptions import HTTPException

from api.serving import FrontendConfig
from api.tokenizer import Tokenizer
from frontends.app import build_app
from orchestrator.app import Orchestrator
from orchestrator.app import build_app as build_orchestrator_app
from orchestrator.config import OrchestratorConfig
from workers.engine.model.tiny import make_tiny_model

LIMIT = 1.05
CHAT = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
                   "ignore_eos": True, "stream": True}).encode()
COUNT = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]}).encode()
# kind -> (app, method, path, body, expected status)
REQUESTS = {"health": ("worker", "GET", "/health", b"", 200),
            "not_found": ("worker", "GET", "/nowhere", b"", 404),
            "chat_stream": ("worker", "POST", "/v1/chat/completions", CHAT, 200),
            "orch_health": ("orchestrator", "GET", "/health", b"", 503),  # no worker behind it: answered at once
            "orch_not_found": ("orchestrator", "GET", "/nowhere", b"", 404),
            "orch_count_tokens": ("orchestrator", "POST", "/v1/messages/count_tokens", COUNT, 200)}


def _scope(method: str, path: str, body: bytes) -> dict[str, Any]:
    headers = [(b"host", b"bench"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": headers,
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}


async def _call(app, method: str, path: str, body: bytes) -> int:
    sent = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.sleep(3600)  # no disconnect while the answer streams
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(_scope(method, path, body), receive, send)
    return status


def _orchestrator_twins(app: Any) -> dict[str, Any]:
    """The orchestrator's app as served, and as a plain Starlette app and as FastAPI with the same arguments."""
    kwargs = {"routes": list(app.router.routes), "middleware": app.user_middleware,
              "exception_handlers": {HTTPException: app.exception_handlers[HTTPException]}}
    twins = {"documented": app, "starlette": Starlette(**kwargs), "fastapi": FastAPI(**kwargs)}
    for twin in twins.values():
        twin.state = app.state
    return twins


def _twins(app: Any) -> dict[str, Any]:
    """The served app and two others over the very same routes, state and (one-layer) middleware stack."""
    served = type(app)  # frontends.app's DocumentedApp subclass

    class StarlettePath(Starlette):
        build_middleware_stack = served.build_middleware_stack

    class FastAPIPath(served):
        __call__ = FastAPI.__call__

    plain = StarlettePath(routes=list(app.router.routes))
    plain.frontend_id, plain.max_request_bytes, plain.admission = app.frontend_id, app.max_request_bytes, \
        app.admission
    fastapi_path = FastAPIPath(app.frontend_id, app.max_request_bytes, app.admission, app.version,
                               routes=list(app.router.routes))
    fastapi_path.router.middleware_stack = fastapi_path.router.app  # APIRouter's own dispatch
    for twin in (plain, fastapi_path):
        twin.state = app.state
    return {"documented": app, "starlette": plain, "fastapi": fastapi_path}


async def _round(apps: dict[str, Any], kind: str, n: int, turn: int = 0) -> dict[str, float]:
    """CPU seconds per request of each app; ``turn`` rotates which app goes first (no order bias)."""
    _, method, path, body, expected = REQUESTS[kind]
    per_request = {}
    order = list(apps.items())
    for name, app in order[turn % len(order):] + order[:turn % len(order)]:
        start = time.process_time()
        for _ in range(n):
            status = await _call(app, method, path, body)
        per_request[name] = (time.process_time() - start) / n
        assert status == expected, (name, kind, status)
    return per_request


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="app-dispatch-")) / "tiny", size="test")
    client = InprocEngineClient(make_synthetic_core(max_model_len=256))
    await client.start()
    tokenizer = Tokenizer.from_model_dir(model_dir)
    orch = Orchestrator(OrchestratorConfig(model_dir=str(model_dir), state_dir=str(model_dir.parent)), 0, tokenizer)
    apps = {"worker": _twins(build_app(client, tokenizer, FrontendConfig.for_model_dir(model_dir))),
            "orchestrator": _orchestrator_twins(build_orchestrator_app(orch))}
    results: dict[str, Any] = {}
    try:
        for kind, (target, *_) in REQUESTS.items():
            n = args.requests if kind != "chat_stream" else max(1, args.requests // 4)
            await _round(apps[target], kind, max(1, n // 10))  # warm-up
            rounds = [await _round(apps[target], kind, n, turn) for turn in range(args.rounds)]
            results[kind] = {name: statistics.median(r[name] for r in rounds) * 1e6 for name in apps[target]}
            results[kind]["requests_per_round"] = n
    finally:
        await client.close()
        orch.legs.close()
        orch.responses.store.close()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="per app per round (streams: a quarter)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "app_dispatch.json"))
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    print("CPU µs per request (median over rounds), and the ratio to the Starlette baseline")
    passed = True
    for kind, row in results.items():
        ratio = row["documented"] / row["starlette"]
        passed &= ratio <= LIMIT
        print(f"  {kind:17} documented {row['documented']:8.1f}  starlette {row['starlette']:8.1f}  "
              f"fastapi-path {row['fastapi']:8.1f}  documented/starlette {ratio:.3f}  "
              f"fastapi-path/starlette {row['fastapi'] / row['starlette']:.3f}")
        row["ratio_documented_to_starlette"] = ratio
    print(f"{'PASS' if passed else 'FAIL'} documented app CPU/request within {LIMIT:g}x Starlette's on every kind")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"results": results, "limit": LIMIT, "passed": passed}, indent=2))
    print(f"wrote {out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
