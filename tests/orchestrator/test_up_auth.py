"""A local `disagg up` with an API key is authenticated everywhere (issue 27, item 4): every route of the
orchestrator but /health needs the API key, every route of every worker but /health needs the
deployment's worker key (which `up` made and the orchestrator presents), neither key is on a command
line, in an environment or in a log, and status, bench, drain and a worker registered by hand work."""

from __future__ import annotations

import functools
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from orchestrator_process import wait_until
from test_up import disagg, write_deployment
from worker_process import free_port

pytestmark = pytest.mark.slow

API_KEY = "sk-deployment-api-key-4242"
ORCHESTRATOR_GETS = ["/version", "/cluster_info", "/metrics", "/prometheus/metrics", "/perf_metrics", "/workers",
                     "/settings", "/v1/models", "/v1/models/x", "/v1/messages/batches", "/v1/responses/resp_x",
                     "/v1/responses/resp_x/input_items"]
ORCHESTRATOR_POSTS = ["/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
                      "/v1/responses", "/tokenize", "/detokenize", "/workers/register", "/workers/heartbeat",
                      "/workers/deregister", "/workers/drain", "/workers/undrain", "/settings",
                      "/v1/messages/batches"]
WORKER_GETS = ["/metrics", "/kv_cache_events", "/kv_cache_snapshot", "/perf_metrics", "/prometheus/metrics",
               "/worker_info", "/version", "/v1/models", "/v1/messages/batches", "/openapi.json"]
WORKER_POSTS = ["/v1/completions", "/v1/chat/completions", "/v1/messages", "/start_profile", "/stop_profile",
                "/kv_cache_events", "/tokenize"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """(orchestrator URL, run dir, state.json) of a ctx worker and a gen worker of two frontends behind
    two orchestrator processes, with an API key."""
    tmp = tmp_path_factory.mktemp("up-auth")
    port = free_port()
    config = write_deployment(tmp, "auth", port=port, processes=2, gen_frontends=2)
    Path(config).write_text(Path(config).read_text().replace("processes: 2,", f"processes: 2, api_key: {API_KEY},"))
    up = disagg("up", config, cwd=tmp)
    run = tmp / "run"
    try:
        assert up.returncode == 0, up.stdout + up.stderr + (run / "up.log").read_text()
        yield f"http://127.0.0.1:{port}", run, json.loads((run / "state.json").read_text()), tmp
    finally:
        disagg("down", "--run-dir", str(run), cwd=tmp)


def _worker_urls(state: dict) -> list[str]:
    return [p["url"] for p in state["processes"] if p["name"] != "orchestrator"]


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _request(method: str, url: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.request(method, url, headers=headers, json={} if method == "POST" else None, timeout=30)


def test_the_keys_are_files_of_the_run_dir_readable_by_their_owner_only(deployment):
    url, run, state, _ = deployment
    for name in ("cluster.key", "worker.key", "api.key", "orchestrator.json"):
        assert stat.S_IMODE((run / name).stat().st_mode) == 0o600, name
    assert (run / "api.key").read_text() == API_KEY
    assert len((run / "worker.key").read_text()) == 64
    assert json.loads((run / "orchestrator.json").read_text())["worker_key_file"] == str((run / "worker.key").resolve())


def test_every_orchestrator_route_but_health_needs_the_api_key(deployment):
    url, run, _, _ = deployment
    worker_key = (run / "worker.key").read_text()
    for method, paths in (("GET", ORCHESTRATOR_GETS), ("POST", ORCHESTRATOR_POSTS)):
        for path in paths:
            for headers in ({}, _bearer("wrong"), _bearer(worker_key)):  # the worker key is no API key
                response = _request(method, url + path, headers)
                assert response.status_code == 401, (method, path, response.text)
                body = response.json()
                code = body["error"]["type"] if body.get("type") == "error" else body["error"]["code"]
                assert code in ("authentication_error", "invalid_api_key"), body
    assert httpx.get(f"{url}/health").status_code == 200
    # The API's description stays open (no state in it): a browser can load /docs, then Authorize.
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(url + path).status_code == 200, path
    for path in ("/cluster_info", "/metrics", "/perf_metrics", "/version", "/settings"):
        assert httpx.get(url + path, headers={"x-api-key": API_KEY}).status_code == 200, path


def test_every_worker_route_but_health_needs_the_worker_key(deployment):
    _, run, state, _ = deployment
    worker_key = (run / "worker.key").read_text()
    for worker in _worker_urls(state):
        for method, paths in (("GET", WORKER_GETS), ("POST", WORKER_POSTS)):
            for path in paths:
                for headers in ({}, _bearer(API_KEY)):  # the clients' API key opens no worker
                    response = _request(method, worker + path, headers)
                    assert response.status_code == 401, (worker, method, path, response.text)
                    assert "worker key" in response.text
        assert httpx.get(f"{worker}/health").json()["status"] == "ok"
        for path in ("/metrics", "/kv_cache_snapshot", "/perf_metrics", "/worker_info", "/prometheus/metrics"):
            assert httpx.get(worker + path, headers=_bearer(worker_key)).status_code == 200, (worker, path)


def test_requests_status_bench_and_drain_work_with_the_keys(deployment):
    url, run, _, tmp = deployment
    model = str(tmp / "model")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    raw = client.completions.with_raw_response.create(model=model, prompt="hello there", max_tokens=3)
    assert raw.headers["x-disagg-mode"] == "disagg"  # both legs: the orchestrator presented the worker key
    chunks = list(client.chat.completions.create(model=model, max_tokens=4, stream=True,
                                                 messages=[{"role": "user", "content": "hi"}]))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")

    status = disagg("status", "--run-dir", str(run), cwd=tmp)
    assert status.returncode == 0 and status.stdout.count(" healthy") >= 2, status.stdout + status.stderr
    as_json = json.loads(disagg("status", "--json", "--run-dir", str(run), cwd=tmp).stdout)
    assert sorted(w["role"] for w in as_json["workers"]) == ["ctx", "gen"]  # the orchestrator's view, with the key

    out = tmp / "bench"
    bench = subprocess.run([sys.executable, "-m", "disagg.cli", "bench", url, "--api-key", API_KEY,
                            "--concurrency", "2", "--num-requests", "4", "--turns", "1", "--isl", "20", "--osl", "4",
                            "--system-tokens", "0", "--no-plots", "--out", str(out), "--name", "auth"],
                           capture_output=True, text=True, cwd=tmp, timeout=120)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    result = json.loads((out / "auth.json").read_text())
    assert result["runs"][0]["num_ok"] == 4 and result["server"]["cluster_info"] is not None

    drain = disagg("drain", "gen-0", "--keep", "--force", "--run-dir", str(run), cwd=tmp)
    assert drain.returncode == 0, drain.stdout + drain.stderr
    undrain = disagg("undrain", "gen-0", "--run-dir", str(run), cwd=tmp)
    assert undrain.returncode == 0, undrain.stdout + undrain.stderr


def test_prometheus_config_presents_each_key_from_its_file(deployment):
    url, run, state, _ = deployment
    config = (run / "prometheus.yml").read_text()
    assert f'credentials_file: "{(run / "api.key").resolve()}"' in config
    assert f'credentials_file: "{(run / "worker.key").resolve()}"' in config
    assert API_KEY not in config and (run / "worker.key").read_text() not in config
    # What Prometheus sends (Authorization: Bearer <the file's content>) is what each server takes.
    assert httpx.get(f"{url}/prometheus/metrics", headers=_bearer((run / "api.key").read_text())).status_code == 200
    worker = _worker_urls(state)[0]
    assert httpx.get(f"{worker}/prometheus/metrics",
                     headers=_bearer((run / "worker.key").read_text())).status_code == 200


def test_neither_key_is_on_a_command_line_in_an_environment_or_in_a_log(deployment):
    url, run, state, tmp = deployment
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):  # refused requests are logged (access lines) ...
        client.models.list()
    assert httpx.get(f"{_worker_urls(state)[0]}/metrics").status_code == 401
    keys = [(run / "worker.key").read_bytes(), API_KEY.encode(), (run / "cluster.key").read_bytes()]
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    checked = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone meanwhile, or not ours
            continue
        mine = str(run).encode() in cmdline
        checked += mine
        for key in keys:
            assert key not in cmdline, (pid, cmdline[:200])
            assert not mine or key not in environ, (pid, cmdline[:200])
    assert checked >= 4  # the supervisor, both workers' launchers and frontends, the orchestrator
    logs = [run / "up.log", *(run / "logs").glob("*.log")]
    assert len(logs) >= 4
    for log in logs:
        text = log.read_bytes()
        for key in keys:
            assert key not in text, log  # ... without a key


def _serve_by_hand(run: Path, tmp: Path, url: str, port: int, worker_key_file: Path) -> subprocess.Popen:
    model = str(tmp / "model")
    log = open(tmp / f"by-hand-{port}.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "disagg.cli", "serve", model, "--engine", "synthetic", "--role", "gen",
         "--port", str(port), "--num-frontends", "1", "--served-model-name", model,
         "--cluster-key-file", str(run / "cluster.key"), "--worker-key-file", str(worker_key_file),
         "--register", url, "--register-api-key-file", str(run / "api.key")], stdout=log, stderr=log)


def _listed(url: str, worker_url: str) -> dict:
    workers = httpx.get(f"{url}/cluster_info", headers=_bearer(API_KEY), timeout=5).json()["workers"]
    return next((w for w in workers if w["url"] == worker_url), {})


def _joined(url: str, worker_url: str) -> bool:
    listed = _listed(url, worker_url)
    return bool(listed.get("healthy") and listed["block_size"])


def _refused(url: str, worker_url: str) -> bool:
    return "worker key" in (_listed(url, worker_url).get("last_error") or "")


def test_a_worker_started_by_hand_joins_with_the_worker_key_and_not_with_another(deployment):
    url, run, _, tmp = deployment
    other_key = tmp / "other-worker.key"
    other_key.write_text("not the deployment's worker key")
    other_key.chmod(0o600)
    for key_file, joins in ((run / "worker.key", True), (other_key, False)):
        port = free_port()
        worker_url = f"http://127.0.0.1:{port}"
        worker = _serve_by_hand(run, tmp, url, port, key_file)
        try:
            if joins:  # registered, and its /worker_info read with the worker key
                wait_until(functools.partial(_joined, url, worker_url), 90)
            else:  # registered, but kept out of the rotation, and why is said
                wait_until(functools.partial(_refused, url, worker_url), 90)
                assert not _listed(url, worker_url)["healthy"]
                client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
                for i in range(4):  # nothing is routed to it
                    client.completions.create(model=str(tmp / "model"), prompt=f"still {i}", max_tokens=2)
            assert httpx.get(f"{worker_url}/worker_info").status_code == 401
        finally:
            worker.terminate()
            worker.wait(60)
