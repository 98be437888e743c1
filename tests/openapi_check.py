"""Checks of a live ``/openapi.json`` (shared by the worker and orchestrator tests).

    doc = http.get("/openapi.json").json()
    assert operation_problems(doc) == []
    assert undocumented_routes(app.routes, documented(doc)) == []
    check_answer(doc, "POST", "/v1/chat/completions", response)   # the live answer fits its schema
    call_checked(http, doc, "GET", "/v1/models/{model_id}", "/v1/models/tiny")   # the same, in one call
    call_checked(http, doc, "POST", "/v1/chat/completions", json={..., "stream": True})   # every event's data
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema

__all__ = ["documented", "operations", "operation_problems", "check_answer", "call_checked", "CalledModules"]

_METHODS = ("get", "post", "put", "patch", "delete")


def documented(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in doc["paths"].items() for method in item if method in _METHODS}


def operations(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            yield method.upper(), path, operation


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def operation_problems(doc: dict[str, Any]) -> list[str]:
    """What a documented operation lacks: a request schema (POST), a 200 and an error schema, a $ref target."""
    problems = []
    components = doc["components"]["schemas"]
    for method, path, operation in operations(doc):
        name = f"{method} {path}"
        request_content = operation.get("requestBody", {}).get("content", {})  # JSON, or a multipart upload
        if method == "POST" and not any(media.get("schema") for media in request_content.values()):
            problems.append(f"{name}: no request schema")
        responses = operation.get("responses", {})
        for status in ("200", "4XX", "5XX"):
            content = responses.get(status, {}).get("content", {})
            if not content or not all(media.get("schema") for media in content.values()):
                problems.append(f"{name}: no {status} schema")
        if "text/event-stream" in responses.get("200", {}).get("content", {}) \
                and not responses["200"]["content"]["text/event-stream"].get("x-event-data"):
            problems.append(f"{name}: no schema of its events' data")
        params = set(re.findall(r"{(\w+)}", path))
        if params != {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}:
            problems.append(f"{name}: path parameters {sorted(params)} not all documented")
    for ref in set(_refs(doc)):
        if ref.rsplit("/", 1)[-1] not in components:
            problems.append(f"dangling {ref}")
    return problems


def check_answer(doc: dict[str, Any], method: str, path: str, response: httpx.Response) -> int:
    """``response`` (a live answer of ``METHOD path``, a documented template) fits the documented schema;
    for an event stream, the data of every event does. Returns how many events were checked (0: none)."""
    operation = doc["paths"][path][method.lower()]
    status = "200" if response.status_code < 400 else f"{str(response.status_code)[0]}XX"
    media = response.headers["content-type"].split(";")[0]
    documented = operation["responses"][status]["content"][media]
    if media == "text/event-stream":
        validator = _validator(documented["x-event-data"], doc)
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        for data in events:
            if data != "[DONE]":
                validator.validate(json.loads(data))
        return len(events)
    body = json.loads(response.content) if media == "application/json" else response.text
    _validator(documented["schema"], doc).validate(body)
    return 0


def _validator(schema: dict[str, Any], doc: dict[str, Any]) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})  # "#/components/..." refs


def call_checked(http: httpx.Client, doc: dict[str, Any], method: str, template: str, path: str | None = None,
                 **kwargs: Any) -> httpx.Response:
    """``METHOD path`` (default: the template itself) on ``http``, its answer checked against ``doc``."""
    response = http.request(method, path or template, **kwargs)
    check_answer(doc, method, template, response)
    return response


class CalledModules:
    """The top-level packages of every Python function called on this thread between enter and exit
    (the event loop's thread: every coroutine and callback that runs meanwhile)."""

    def __init__(self) -> None:
        self.packages: set[str] = set()

    def _profile(self, frame, event, arg) -> None:
        if event == "call":
            self.packages.add(frame.f_globals.get("__name__", "").split(".")[0])

    def __enter__(self) -> set[str]:
        sys.setprofile(self._profile)
        return self.packages

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
