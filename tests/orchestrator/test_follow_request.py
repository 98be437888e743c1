"""One request followed through a real `disagg up` deployment (orchestrator, ctx and gen worker):
its spans reach a real OTLP/HTTP receiver process linked into the client's trace, and with
``log_format: json`` every log line is JSON and the request's id is in every process's log."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_up import disagg, write_deployment
from worker_process import free_port

pytestmark = pytest.mark.slow

RECEIVER = Path(__file__).resolve().parent.parent / "otlp_receiver.py"


def _up(tmp_path: Path, port: int, extra: str, env: dict[str, str] | None = None) -> Path:
    config = write_deployment(tmp_path, port=port, extra=extra)
    up = subprocess.run([sys.executable, "-m", "disagg.cli", "up", config], cwd=tmp_path, capture_output=True,
                        text=True, timeout=180, env={**os.environ, **(env or {})})
    run = tmp_path / "run"
    assert up.returncode == 0, up.stdout + up.stderr + (run / "up.log").read_text()
    return run


def _chat(port: int, headers: dict[str, str], stream: bool, query: str = "") -> httpx.Response:
    body = {"model": "m", "max_tokens": 4, "stream": stream, "messages": [{"role": "user", "content": "follow me"}],
            **({"stream_options": {"include_usage": True}} if stream else {})}
    with httpx.Client(timeout=60) as client:
        model = client.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        response = client.post(f"http://127.0.0.1:{port}/v1/chat/completions{query}", json={**body, "model": model},
                               headers=headers)
    assert response.status_code == 200, response.text
    return response


def _require_tracing_extra() -> None:
    import importlib.util

    if importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is None:
        if os.environ.get("CI"):
            pytest.fail("the [tracing] extra is not installed; make setup installs it")
        pytest.skip("the [tracing] extra is not installed (pip install -e '.[tracing]')")


@pytest.fixture
def receiver(tmp_path):
    _require_tracing_extra()
    spans_file = tmp_path / "spans.jsonl"
    proc = subprocess.Popen([sys.executable, str(RECEIVER), str(spans_file)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening "), line
        yield int(line.split()[1]), spans_file
    finally:
        proc.terminate()
        proc.wait(10)


def _spans(spans_file: Path, trace_id: str) -> list[dict]:
    spans = [json.loads(line) for line in spans_file.read_text().splitlines() if line]
    return [span for span in spans if span["trace_id"] == trace_id]


WANTED = {"request", "orchestrator.prepare", "ctx_leg", "gen_leg", "worker.request", "engine.queue", "engine.prefill",
          "engine.kv_transfer", "engine.decode"}


def test_a_requests_spans_link_up_across_the_orchestrator_and_both_workers(tmp_path, receiver):
    receiver_port, spans_file = receiver
    port = free_port()
    run = _up(tmp_path, port, f"tracing: {{otlp_endpoint: 'http://127.0.0.1:{receiver_port}', service_name: t}}\n",
              env={"OTEL_BSP_SCHEDULE_DELAY": "100"})  # the SDK's batch delay: spans out within 0.1 s
    traces = {}
    try:
        # Streamed on the fast lane; then JSON on the ASGI routes (a query string leaves the fast lane).
        for request_id, stream, query in (("traced-1", True, ""), ("traced-2", False, "?via=asgi")):
            trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
            response = _chat(port, {"traceparent": f"00-{trace_id}-{client_span}-01", "x-request-id": request_id},
                             stream=stream, query=query)
            assert response.headers["x-disagg-mode"] == "disagg"
            traces[request_id] = trace_id, client_span
        deadline = time.monotonic() + 30
        while (not all(WANTED <= {s["name"] for s in _spans(spans_file, trace_id)} for trace_id, _ in traces.values())
               and time.monotonic() < deadline):
            time.sleep(0.2)
        spans = {request_id: _spans(spans_file, trace_id) for request_id, (trace_id, _) in traces.items()}
    finally:
        down = disagg("down", "--run-dir", str(run), cwd=tmp_path)
        assert down.returncode == 0, down.stdout + down.stderr
    for request_id, (_, client_span) in traces.items():
        _check_trace(spans[request_id], client_span, request_id)


def _check_trace(spans: list[dict], client_span: str, request_id: str) -> None:
    names = sorted(s["name"] for s in spans)
    assert WANTED <= set(names), names
    by_id = {s["span_id"]: s for s in spans}

    def one(name: str, service: str) -> dict:
        (span,) = [s for s in spans if s["name"] == name and s["service"] == service]
        return span

    root = one("request", "t-orchestrator")
    assert root["parent_span_id"] == client_span  # the client's trace continues
    attributes = root["attributes"]
    assert attributes["disagg.request_id"] == request_id and attributes["disagg.status"] == 200
    assert attributes["disagg.completion_tokens"] == 4 and attributes["disagg.prompt_tokens"] > 0
    ctx_leg, gen_leg = one("ctx_leg", "t-orchestrator"), one("gen_leg", "t-orchestrator")
    assert ctx_leg["parent_span_id"] == gen_leg["parent_span_id"] == root["span_id"]
    assert ctx_leg["end"] <= gen_leg["start"]
    ctx_worker, gen_worker = one("worker.request", "t-ctx"), one("worker.request", "t-gen")
    assert ctx_worker["parent_span_id"] == ctx_leg["span_id"]  # across processes, through the leg's traceparent
    assert gen_worker["parent_span_id"] == gen_leg["span_id"]
    assert ctx_worker["attributes"]["disagg.x_request_id"] == f"{request_id}-ctx"
    assert gen_worker["attributes"]["disagg.x_request_id"] == f"{request_id}-gen"
    assert one("engine.prefill", "t-ctx")["parent_span_id"] == ctx_worker["span_id"]
    for name in ("engine.queue", "engine.kv_transfer", "engine.decode"):
        assert one(name, "t-gen")["parent_span_id"] == gen_worker["span_id"]
    for span in spans:  # every span hangs, step by step, from the client's
        parent = span["parent_span_id"]
        while parent in by_id:
            parent = by_id[parent]["parent_span_id"]
        assert parent == client_span, span
        assert span["start"] <= span["end"]


def _log_lines(run: Path) -> dict[str, list[str]]:
    return {path.stem: path.read_text().splitlines() for path in sorted((run / "logs").glob("*.log"))}


def test_json_logs_name_one_request_in_every_process(tmp_path):
    port = free_port()
    run = _up(tmp_path, port, "log_format: json\naccess_log: true\n")
    try:
        _chat(port, {"x-request-id": "follow-me-7"}, stream=False)
        _chat(port, {"x-request-id": "follow-me-8"}, stream=True)
        with httpx.Client() as client:  # polls: not in the access log
            assert client.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        down = disagg("down", "--run-dir", str(run), cwd=tmp_path)
        assert down.returncode == 0, down.stdout + down.stderr
    logs = _log_lines(run)
    assert {"ctx-0", "gen-0", "orchestrator"} <= set(logs)
    entries: dict[str, list[dict]] = {}
    for name, lines in logs.items():
        if name == "supervisor":
            continue  # `disagg up`'s own log: not a process of the deployment
        for line in lines:
            try:
                entries.setdefault(name, []).append(json.loads(line))
            except json.JSONDecodeError:
                pytest.fail(f"{name}.log has a line that is not JSON: {line!r}")
    for name in ("orchestrator", "ctx-0", "gen-0"):
        assert any(e.get("request_id", "").startswith("follow-me-7") for e in entries[name]), (name, entries[name])
    access = [e for e in entries["orchestrator"] if e["logger"] == "disagg.access"]
    assert [(e["request_id"], e["path"], e["status"], e["mode"], e["completion_tokens"]) for e in access] == [
        ("follow-me-7", "/v1/chat/completions", 200, "disagg", 4), ("follow-me-8", "/v1/chat/completions", 200, "disagg", 4)]
    assert all(e["ctx_worker"] and e["gen_worker"] and e["prompt_tokens"] > 0 and e["latency_ms"] > 0 for e in access)
    for name, suffix in (("ctx-0", "ctx"), ("gen-0", "gen")):  # the workers' access lines carry the leg's id
        lines = [e for e in entries[name] if e["logger"] == "uvicorn.access"]
        assert {e.get("request_id") for e in lines} == {f"follow-me-7-{suffix}", f"follow-me-8-{suffix}"}, lines
    everything = [e["msg"] for es in entries.values() for e in es]
    assert not [m for m in everything if "GET /health" in m]  # polls stay out of the access log
