"""A worker started with --worker-key-file answers only who presents the key: every route of every
frontend (the launcher's own and the ones an attached frontend replays to it) but /health is a 401 in
the route's API error shape without it, and serves as before with it. Real processes, real HTTP."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess

import httpx
import pytest
from worker_process import start_worker, stop_worker, worker_log, write_private_file

from api.api_key import KeyFileError, RequiredKey, read_key_file

# Every route family of a worker: generation, the client surface, the launcher-owned drains and
# profiler, the batches and stored responses, the Prometheus scrape and the API's own description.
GETS = ["/v1/models", "/v1/models/tiny-test", "/version", "/worker_info", "/metrics", "/kv_cache_events",
        "/kv_cache_snapshot", "/perf_metrics", "/prometheus/metrics", "/v1/messages/batches",
        "/v1/messages/batches/msgbatch_x", "/v1/responses/resp_x", "/openapi.json", "/docs", "/nowhere"]
POSTS = ["/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
         "/tokenize", "/detokenize", "/kv_cache_events", "/start_profile", "/stop_profile", "/v1/messages/batches"]
COMPLETION = {"model": "tiny-test", "prompt": "hello", "max_tokens": 3}


@pytest.fixture(scope="module")
def keyed_worker(tiny_model_dir, tmp_path_factory):
    """A worker of two frontends (a launcher and one attached) that requires a worker key."""
    key = secrets.token_hex(32)
    key_file = tmp_path_factory.mktemp("worker-key") / "worker.key"
    write_private_file(key_file, key.encode())
    url, proc = start_worker(tiny_model_dir, 2, extra_args=["--worker-key-file", str(key_file)])
    yield url, key, proc
    stop_worker(proc)


def _frontends(url: str, path: str, headers: dict[str, str], method: str = "GET") -> dict[str, httpx.Response]:
    """One answer per frontend that answered ``method path`` (fresh connections spread over both)."""
    answers: dict[str, httpx.Response] = {}
    for _ in range(40):
        response = httpx.request(method, url + path, headers=headers, json={} if method == "POST" else None,
                                 timeout=30)
        answers[response.headers["x-disagg-frontend"]] = response
        if len(answers) == 2:
            break
    return answers


@pytest.mark.slow
def test_every_route_but_health_needs_the_key_on_every_frontend(keyed_worker):
    url, key, _ = keyed_worker
    for method, paths in (("GET", GETS), ("POST", POSTS)):
        for path in paths:
            wrongs = [{}] if path not in ("/metrics", "/v1/completions") else \
                [{}, {"Authorization": "Bearer not-the-key"}, {"x-api-key": key[:-1]}, {"Authorization": key}]
            for wrong in wrongs:
                answers = _frontends(url, path, wrong, method)
                assert set(answers) == {"0", "1"}, (method, path)
                for frontend, response in answers.items():
                    assert response.status_code == 401, (method, path, frontend, response.text)
                    error = response.json()
                    if path.startswith("/v1/messages"):  # Anthropic's shape
                        assert error["type"] == "error" and error["error"]["type"] == "authentication_error"
                    else:
                        assert error["error"]["code"] == "invalid_api_key", error
                    assert "worker key" in response.text
    for frontend, response in _frontends(url, "/health", {}).items():
        assert response.status_code == 200 and response.json()["status"] == "ok", frontend


@pytest.mark.slow
def test_with_the_key_every_frontend_serves_and_replays_launcher_routes(keyed_worker):
    url, key, _ = keyed_worker
    for headers in ({"Authorization": f"Bearer {key}"}, {"x-api-key": key}):
        for path in ("/metrics", "/kv_cache_events", "/kv_cache_snapshot", "/perf_metrics", "/worker_info",
                     "/prometheus/metrics", "/v1/messages/batches", "/openapi.json"):
            for frontend, response in _frontends(url, path, headers).items():
                assert response.status_code == 200, (path, frontend, response.text)
        answers = _frontends(url, "/start_profile", headers, "POST")  # the synthetic engine has no profiler
        assert {r.status_code for r in answers.values()} == {501}
        completion = httpx.post(f"{url}/v1/completions", headers=headers, json=COMPLETION, timeout=30)
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3


def test_the_key_is_in_no_argv_and_no_log_line(keyed_worker):
    url, key, proc = keyed_worker
    httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=30)  # a refused request is logged...
    pids = [proc.pid, *_descendants(proc.pid)]
    assert len(pids) >= 3  # the launcher, its engine, the attached frontend
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert key.encode() not in f.read(), pid
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert key.encode() not in f.read(), pid
    assert key not in worker_log(proc)  # ...without the key


def _descendants(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(c) for c in children] + [d for c in children for d in _descendants(int(c))]


def test_a_bad_key_file_is_refused_before_the_worker_starts(tiny_model_dir, tmp_path):
    key_file = tmp_path / "worker.key"
    key_file.write_text(secrets.token_hex(32))
    os.chmod(key_file, 0o644)
    from worker_process import spawn_worker

    proc = spawn_worker(tiny_model_dir, 1, "synthetic", None, ["--worker-key-file", str(key_file)])
    assert proc.wait(60) == 2
    assert "worker_key_file" in worker_log(proc) and "must be 0600" in worker_log(proc)


def test_read_key_file_and_the_check(tmp_path):
    path = tmp_path / "k"
    write_private_file(path, b"  sesame\n")
    assert read_key_file(path) == "sesame"
    os.chmod(path, stat.S_IRUSR | stat.S_IRGRP)
    with pytest.raises(KeyFileError, match="must be 0600"):
        read_key_file(path)
    empty = tmp_path / "empty"
    write_private_file(empty, b"\n")
    with pytest.raises(KeyFileError, match="empty"):
        read_key_file(empty)
    with pytest.raises(KeyFileError, match="cannot read"):
        read_key_file(tmp_path / "missing")
    key = RequiredKey("sesame")
    assert "sesame" not in repr(key)
    assert key.accepts(None, b"Bearer sesame") and key.accepts(None, b"bearer  sesame ")
    assert key.accepts(b"sesame", None) and not key.accepts(b"wrong", b"Bearer sesame")  # x-api-key wins
    assert not key.accepts(None, b"Basic sesame") and not key.accepts(None, None)
