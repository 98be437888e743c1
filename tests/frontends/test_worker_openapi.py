"""/openapi.json and /docs of a real K=2 worker (launcher + attached frontend, synthetic engine).

The schema documents every route that either frontend app serves (walked from the apps built
in-process, as ``disagg serve`` builds them), with a request schema for every POST and answer schemas;
live answers, errors included, validate against it; every frontend serves the same document.
"""

from __future__ import annotations

import re
import time

import httpx
import jsonschema
import openapi_spec_validator
import pytest
from http_harness import worker_apps
from openapi_check import CalledModules, call_checked, check_answer, documented, operation_problems
from worker_process import start_worker, stop_worker

from api.openapi import undocumented_routes, unserved_docs
from api.openapi_routes import WORKER_DOCS

MODEL = "tiny-test"
USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=2)
    with httpx.Client(base_url=url, timeout=30) as http:
        yield http, http.get("/openapi.json").json()
    assert stop_worker(proc) == 0


def test_every_served_route_is_documented(worker, tiny_model_dir, tokenizer, tmp_path):
    http, doc = worker
    openapi_spec_validator.validate(doc)  # a valid OpenAPI 3.1 document, as tools read it
    assert operation_problems(doc) == []
    for name, app in worker_apps(tiny_model_dir, tokenizer, tmp_path).items():
        assert undocumented_routes(app.routes, documented(doc)) == [], name
        assert unserved_docs(app.routes, WORKER_DOCS) == [], name
    assert documented(doc) == {(d.method, d.path) for d in WORKER_DOCS}
    # A route the table forgot is caught (the check can fail).
    from starlette.routing import Route

    assert undocumented_routes([Route("/v1/new_thing", lambda r: None, methods=["POST"])], documented(doc)) \
        == ["POST /v1/new_thing"]


def test_every_frontend_serves_the_same_document_and_docs_page(worker):
    http, doc = worker
    served_by = set()
    for _ in range(40):  # fresh connections: the kernel spreads them over both frontends
        with httpx.Client(base_url=str(http.base_url), timeout=30) as fresh:
            response = fresh.get("/openapi.json")
        assert response.status_code == 200 and response.json() == doc
        served_by.add(response.headers["x-disagg-frontend"])
        if served_by == {"0", "1"}:
            break
    assert served_by == {"0", "1"}
    page = http.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "swagger-ui" in page.text and "/openapi.json" in page.text
    # Everything the page loads comes from this server (no CDN: an offline server room gets docs too).
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert assets and all(a.startswith("/docs/assets/") for a in assets), assets
    for asset in assets:
        loaded = http.get(asset)
        assert loaded.status_code == 200 and len(loaded.content) > 500, asset
    assert http.get("/docs/assets/index.html").status_code == 404
    assert doc["info"]["title"] == "disagg worker"
    request_schema = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert request_schema["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert "max_tokens" in doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]


def test_live_answers_fit_their_schemas(worker):
    http, doc = worker
    chat = {"model": MODEL, "messages": USER, "max_tokens": 3}
    assert call_checked(http, doc, "POST", "/v1/chat/completions", json=chat).status_code == 200
    call_checked(http, doc, "POST", "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    call_checked(http, doc, "POST", "/v1/messages", json={"model": MODEL, "messages": USER, "max_tokens": 3})
    call_checked(http, doc, "POST", "/v1/messages/count_tokens", json={"model": MODEL, "messages": USER})
    call_checked(http, doc, "GET", "/v1/models")
    call_checked(http, doc, "GET", "/v1/models/{model_id}", f"/v1/models/{MODEL}")
    tokens = call_checked(http, doc, "POST", "/tokenize", json={"prompt": "Hello", "return_token_strs": True}).json()
    call_checked(http, doc, "POST", "/detokenize", json={"tokens": tokens["tokens"]})
    for path in ("/health", "/version", "/worker_info", "/metrics", "/kv_cache_events", "/perf_metrics"):
        call_checked(http, doc, "GET", path)
    call_checked(http, doc, "POST", "/kv_cache_events")
    response = call_checked(http, doc, "POST", "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 3})
    response_id = response.json()["id"]
    call_checked(http, doc, "GET", "/v1/responses/{response_id}", f"/v1/responses/{response_id}")
    call_checked(http, doc, "GET", "/v1/responses/{response_id}/input_items", f"/v1/responses/{response_id}/input_items")
    call_checked(http, doc, "DELETE", "/v1/responses/{response_id}", f"/v1/responses/{response_id}")
    batch = call_checked(http, doc, "POST", "/v1/messages/batches",
                  json={"requests": [{"custom_id": "a", "params": {**chat, "messages": USER}}]}).json()
    call_checked(http, doc, "GET", "/v1/messages/batches")
    deadline = time.monotonic() + 30
    while call_checked(http, doc, "GET", "/v1/messages/batches/{batch_id}",
                f"/v1/messages/batches/{batch['id']}").json()["processing_status"] != "ended":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    call_checked(http, doc, "DELETE", "/v1/messages/batches/{batch_id}", f"/v1/messages/batches/{batch['id']}")


def test_streamed_events_fit_their_schemas(worker):
    http, doc = worker
    chat = {"model": MODEL, "messages": USER, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}
    for template, body in [("/v1/chat/completions", chat),
                           ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": True}),
                           ("/v1/messages", {"model": MODEL, "messages": USER, "max_tokens": 4, "stream": True}),
                           ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "stream": True})]:
        response = call_checked(http, doc, "POST", template, json=body)
        assert response.headers["content-type"].startswith("text/event-stream")
        assert check_answer(doc, "POST", template, response) >= 2, template  # events may coalesce
    # The event checker itself rejects a chat stream's events as a completion stream's.
    chat_stream = http.post("/v1/chat/completions", json=chat)
    with pytest.raises(jsonschema.ValidationError):
        check_answer(doc, "POST", "/v1/completions", chat_stream)


def test_errors_fit_the_documented_error_shapes(worker):
    http, doc = worker
    assert call_checked(http, doc, "POST", "/v1/chat/completions", content=b"{not json").status_code == 400
    bad = call_checked(http, doc, "POST", "/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert call_checked(http, doc, "POST", "/v1/messages", json={"model": MODEL}).status_code == 400
    assert call_checked(http, doc, "GET", "/v1/models/{model_id}", "/v1/models/other").status_code == 404
    assert call_checked(http, doc, "GET", "/v1/responses/{response_id}", "/v1/responses/resp_missing").status_code == 404
    # The checker itself rejects an answer in the other API's shape.
    anthropic_shaped = http.post("/v1/messages", json={"model": MODEL})
    with pytest.raises(jsonschema.ValidationError):
        check_answer(doc, "POST", "/v1/chat/completions", anthropic_shaped)


@pytest.mark.asyncio
async def test_requests_never_run_fastapi_or_pydantic(harness):
    """Every route takes Starlette's path: no FastAPI or pydantic code runs for a request, hot or not,
    answered or refused, while /openapi.json is FastAPI's (so the check can tell)."""
    model = harness.model
    requests = [("POST", "/v1/chat/completions", {"model": model, "messages": USER, "max_tokens": 3, "stream": True}),
                ("POST", "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 3}),
                ("POST", "/v1/messages", {"model": model, "messages": USER, "max_tokens": 3, "stream": True}),
                ("POST", "/v1/responses", {"model": model, "input": "Hi", "max_output_tokens": 3}),
                ("POST", "/v1/chat/completions", {"model": model}),  # 400
                ("GET", "/health", None), ("GET", "/nowhere", None), ("DELETE", "/health", None)]  # 404, 405
    await harness.http.get("/health")  # first-call imports and caches outside the window
    for method, path, body in requests:
        with CalledModules() as packages:
            response = await harness.http.request(method, path, json=body)
        assert response.status_code in (200, 400, 404, 405), response.text
        assert {"starlette", "frontends"} <= packages and not packages & {"fastapi", "pydantic"}, (path, packages)
    with CalledModules() as packages:
        assert (await harness.http.get("/openapi.json")).status_code == 200
    assert "fastapi" in packages
