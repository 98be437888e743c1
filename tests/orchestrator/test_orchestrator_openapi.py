"""/openapi.json and /docs of a real orchestrator (one process) in front of a synthetic worker.

Every route of the orchestrator's app (built in-process as ``disagg orchestrator`` builds it) is in
the live document, every POST with a request schema, and live answers fit the documented schemas.
"""

from __future__ import annotations

import json
import re

import httpx
import openapi_spec_validator
import pytest
from openapi_check import CalledModules, call_checked, documented, operation_problems, operations
from orchestrator_process import start_orchestrator, stop_orchestrator
from worker_process import start_worker, stop_worker

from api.openapi import undocumented_routes, unserved_docs
from api.tokenizer import Tokenizer
from orchestrator.app import Orchestrator, build_app
from orchestrator.config import OrchestratorConfig
from orchestrator.openapi_routes import ORCHESTRATOR_DOCS

MODEL = "tiny-test"
USER = [{"role": "user", "content": "Hello"}]
KEY = "the-key"


@pytest.fixture(scope="module")
def orchestrator(tiny_model_dir, tmp_path_factory):
    worker_url, worker = start_worker(tiny_model_dir, 1)
    url, orch = start_orchestrator(tmp_path_factory.mktemp("orch"), tiny_model_dir, [("both", worker_url)],
                                   processes=1, api_key=KEY)
    with httpx.Client(base_url=url, timeout=30, headers={"x-api-key": KEY}) as http:
        yield http, http.get("/openapi.json").json()
    assert stop_orchestrator(orch) == 0
    stop_worker(worker)


@pytest.fixture
def inproc_app(tiny_model_dir, tmp_path):
    """The app ``disagg orchestrator`` serves, built in-process (its lifespan not run: no state link)."""
    orch = Orchestrator(OrchestratorConfig(model_dir=str(tiny_model_dir), state_dir=str(tmp_path)), 0,
                        Tokenizer.from_model_dir(tiny_model_dir))
    yield build_app(orch)
    orch.legs.close()
    orch.responses.store.close()


def test_every_served_route_is_documented(orchestrator, inproc_app):
    http, doc = orchestrator
    openapi_spec_validator.validate(doc)  # a valid OpenAPI 3.1 document, as tools read it
    assert operation_problems(doc) == []
    routes = inproc_app.routes
    assert undocumented_routes(routes, documented(doc)) == []
    assert unserved_docs(routes, ORCHESTRATOR_DOCS) == []
    assert documented(doc) == {(d.method, d.path) for d in ORCHESTRATOR_DOCS}
    assert doc["info"]["title"] == "disagg orchestrator"
    page = http.get("/docs")
    assert page.status_code == 200 and "swagger-ui" in page.text
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)  # all from this server, no CDN
    assert assets and all(a.startswith("/docs/assets/") for a in assets), assets
    assert all(http.get(a).status_code == 200 for a in assets)


def test_live_answers_fit_their_schemas(orchestrator):
    http, doc = orchestrator
    assert call_checked(http, doc, "POST", "/v1/chat/completions",
                 json={"model": MODEL, "messages": USER, "max_tokens": 3}).status_code == 200
    call_checked(http, doc, "POST", "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    call_checked(http, doc, "POST", "/v1/messages", json={"model": MODEL, "messages": USER, "max_tokens": 3})
    for template, body in [("/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 3}),
                           ("/v1/messages", {"model": MODEL, "messages": USER, "max_tokens": 3})]:
        streamed = call_checked(http, doc, "POST", template, json={**body, "stream": True})
        assert streamed.headers["content-type"].startswith("text/event-stream")
    call_checked(http, doc, "POST", "/v1/messages/count_tokens", json={"model": MODEL, "messages": USER})
    response = call_checked(http, doc, "POST", "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 3})
    call_checked(http, doc, "GET", "/v1/responses/{response_id}", f"/v1/responses/{response.json()['id']}")
    call_checked(http, doc, "GET", "/v1/models")
    call_checked(http, doc, "POST", "/tokenize", json={"prompt": "Hello"})
    for path in ("/health", "/version", "/cluster_info", "/workers", "/perf_metrics"):
        call_checked(http, doc, "GET", path)
    assert "disagg" in call_checked(http, doc, "GET", "/prometheus/metrics").text
    call_checked(http, doc, "GET", "/v1/messages/batches")
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": MODEL, "prompt": "Hi"}}
    upload = call_checked(http, doc, "POST", "/v1/files", data={"purpose": "batch"},
                          files={"file": ("in.jsonl", json.dumps(line).encode())}).json()
    call_checked(http, doc, "GET", "/v1/files")
    call_checked(http, doc, "GET", "/v1/files/{file_id}", f"/v1/files/{upload['id']}")
    batch = call_checked(http, doc, "POST", "/v1/batches", json={"input_file_id": upload["id"], "endpoint":
                         "/v1/completions", "completion_window": "24h"}).json()
    call_checked(http, doc, "GET", "/v1/batches/{batch_id}", f"/v1/batches/{batch['id']}")
    call_checked(http, doc, "GET", "/v1/batches")
    call_checked(http, doc, "DELETE", "/v1/files/{file_id}", f"/v1/files/{upload['id']}")
    # Registration: a worker announces itself, heartbeats, leaves.
    ack = call_checked(http, doc, "POST", "/workers/register", json={"role": "gen", "url": "http://127.0.0.1:9"}).json()
    call_checked(http, doc, "POST", "/workers/heartbeat", json={"worker_id": ack["worker_id"]})
    call_checked(http, doc, "POST", "/workers/deregister", json={"worker_id": ack["worker_id"]})
    # Its errors, relayed from process 0, are in the OpenAI shape too, naming the field.
    for body, param in [({"role": "boss", "url": "http://127.0.0.1:9"}, "role"), ({"role": "gen", "url": 9}, "url"),
                        ({"role": "gen"}, "url"), ([], None)]:
        refused = call_checked(http, doc, "POST", "/workers/register", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    gone = call_checked(http, doc, "POST", "/workers/heartbeat", json={"worker_id": ack["worker_id"]})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "worker_id"
    # Errors: the API's shape, the parameter named.
    bad = call_checked(http, doc, "POST", "/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert call_checked(http, doc, "POST", "/v1/messages", content=b"{").status_code == 400
    assert call_checked(http, doc, "GET", "/v1/models/{model_id}", "/v1/models/other").status_code == 404


def test_the_documented_api_key_is_the_one_asked_for(orchestrator):
    """Operations marked as needing the key answer 401 without it; the others answer without it."""
    http, doc = orchestrator
    assert set(doc["components"]["securitySchemes"]) == {"bearer", "x-api-key"}
    with httpx.Client(base_url=str(http.base_url), timeout=30) as anonymous:
        for method, path, operation in operations(doc):
            response = anonymous.request(method, path.replace("{", "").replace("}", ""))
            assert (response.status_code == 401) == ("security" in operation), (method, path, response.status_code)
        assert anonymous.get("/openapi.json").status_code == 200 and anonymous.get("/docs").status_code == 200
    with httpx.Client(base_url=str(http.base_url), timeout=30, headers={"authorization": f"Bearer {KEY}"}) as bearer:
        assert bearer.get("/v1/models").status_code == 200


@pytest.mark.asyncio
async def test_requests_never_run_fastapi_or_pydantic(inproc_app):
    """Starlette's path for every request (its middleware stack, not FastAPI's), FastAPI's for the docs."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=inproc_app), base_url="http://o") as http:
        await http.get("/version")  # first-call imports and caches outside the window
        for method, path, body in [("GET", "/health", None), ("GET", "/version", None), ("GET", "/nowhere", None),
                                   ("DELETE", "/health", None), ("POST", "/v1/chat/completions", {"model": 1})]:
            with CalledModules() as packages:
                response = await http.request(method, path, json=body)
            assert response.status_code in (200, 400, 404, 405, 503), response.text
            assert {"starlette", "orchestrator"} <= packages and not packages & {"fastapi", "pydantic"}, \
                (path, packages)
        with CalledModules() as packages:
            assert (await http.get("/openapi.json")).status_code == 200
        assert "fastapi" in packages
