"""A running deployment changes under a steady load with no failed request: `disagg drain`, `undrain`, `scale`,
a worker started by hand with `disagg serve --register URL`.

Real processes: `disagg up` (synthetic engines, two orchestrator processes),
a loop of 6 clients sending completions through the orchestrator the whole
time (``live_load``), the commands as a user runs them.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import httpx
import pytest
from live_load import LoadLoop
from orchestrator_process import wait_until
from test_up import disagg, write_deployment
from worker_process import free_port

from common.processes import pid_alive, stop_process

pytestmark = pytest.mark.slow

ENGINE = ", synthetic_decode_step_seconds: 0.01"


def _up(tmp_path, name: str, pools: str, api_key: str | None = None, health: str | None = None
        ) -> tuple[str, str, object]:
    port = free_port()
    config = write_deployment(tmp_path, name, port=port, processes=2, engine=ENGINE)
    text = open(config).read().replace("pools: {ctx: {instances: 1, frontends: 1}, gen: {instances: 1, frontends: 1}}",
                                       f"pools: {pools}")
    if api_key:
        text = text.replace("processes: 2,", f"processes: 2, api_key: {api_key},")
    if health:
        text = text.replace("health: {interval_seconds: 0.2}", f"health: {health}")
    open(config, "w").write(text)
    up = disagg("up", config, cwd=tmp_path)
    run = tmp_path / "run"
    assert up.returncode == 0, up.stdout + up.stderr + (run / "up.log").read_text()
    return f"http://127.0.0.1:{port}", config, run


def _process(run, name: str) -> dict:
    return next(p for p in json.loads((run / "state.json").read_text())["processes"] if p["name"] == name)


@pytest.fixture
def two_gen(tmp_path):
    """A deployment of one ctx and two gen workers: (orchestrator URL, run dir, gen-1's state record)."""
    url, config, run = _up(tmp_path, "drain", "{ctx: {instances: 1}, gen: {instances: 2}}")
    try:
        yield url, run, _process(run, "gen-1")
    finally:
        disagg("down", "--run-dir", str(run), cwd=tmp_path)


def test_drain_keep_then_undrain_under_load(tmp_path, two_gen):
    url, run, gen1 = two_gen
    with LoadLoop(url, str(tmp_path / "model")) as load:
        load.wait_for(12)
        assert load.to(gen1["url"]) > 0  # both gen workers serve
        last = disagg("drain", "ctx-0", "--run-dir", str(run), cwd=tmp_path)  # the only ctx worker
        assert last.returncode == 1 and "no ctx worker in the rotation" in last.stderr, last.stderr
        assert not any(w["draining"] for w in httpx.get(f"{url}/cluster_info").json()["workers"])

        drain = disagg("drain", "gen-1", "--keep", "--run-dir", str(run), cwd=tmp_path)
        drained_at = time.monotonic()
        assert drain.returncode == 0, drain.stdout + drain.stderr
        assert "gen-1: draining" in drain.stdout and "drained (nothing in flight)" in drain.stdout
        load.wait_for(15)
        assert load.to(gen1["url"], after=drained_at) == 0
        status = disagg("status", "--run-dir", str(run), cwd=tmp_path)
        assert f"{gen1['url']:<26} drained;" in status.stdout, status.stdout
        assert pid_alive(gen1["pid"])  # --keep: still running

        undrain = disagg("undrain", "gen-1", "--run-dir", str(run), cwd=tmp_path)
        assert undrain.returncode == 0, undrain.stdout + undrain.stderr
        back_at = time.monotonic()
        load.wait_for(15)
    assert load.failed() == [], load.failed()[:5]
    assert load.to(gen1["url"], after=back_at) > 0


def test_drain_stops_the_worker_for_good_under_load(tmp_path, two_gen):
    url, run, gen1 = two_gen
    with LoadLoop(url, str(tmp_path / "model")) as load:
        load.wait_for(12)
        drain = disagg("drain", gen1["url"], "--run-dir", str(run), cwd=tmp_path)  # by URL
        stopped_at = time.monotonic()
        assert drain.returncode == 0, drain.stdout + drain.stderr
        assert "gen-1: stopped" in drain.stdout
        assert not pid_alive(gen1["pid"])
        load.wait_for(15)
    assert load.failed() == [], load.failed()[:5]
    assert load.to(gen1["url"], after=stopped_at) == 0
    assert _process(run, "gen-1")["retired"] == "drained"
    status = disagg("status", "--json", "--run-dir", str(run), cwd=tmp_path)
    shown = json.loads(status.stdout)
    assert [p["state"] for p in shown["processes"] if p["name"] == "gen-1"] == ["retired"]
    assert gen1["url"] not in [w["url"] for w in shown["workers"]]  # out of the orchestrator's list
    assert gen1["url"] not in (run / "orchestrator.json").read_text()  # a restart would not bring it back
    refused = disagg("undrain", "gen-1", "--run-dir", str(run), cwd=tmp_path)
    assert refused.returncode == 1 and "was stopped" in refused.stderr


def test_scale_a_pool_out_then_in_under_load_with_an_api_key(tmp_path):
    url, config, run = _up(tmp_path, "scale", "{ctx: {instances: 1}, gen: {instances: 1}}", api_key="sesame")
    try:
        with LoadLoop(url, str(tmp_path / "model"), api_key="sesame") as load:
            load.wait_for(10)
            out = disagg("scale", "gen", "2", "--run-dir", str(run), cwd=tmp_path)
            assert out.returncode == 0, out.stdout + out.stderr
            added = _process(run, "gen-1")
            assert "--register-api-key-file" in added["argv"]  # it registered past the API key
            assert stat.S_IMODE((run / "api.key").stat().st_mode) == 0o600
            added_at = time.monotonic()
            load.wait_for(30)
            assert load.to(added["url"], after=added_at) > 0  # the new worker serves

            scaled_in = disagg("scale", "gen", "1", "--run-dir", str(run), cwd=tmp_path)
            removed_at = time.monotonic()
            assert scaled_in.returncode == 0, scaled_in.stdout + scaled_in.stderr
            assert "gen-1: stopped" in scaled_in.stdout
            load.wait_for(30)
        assert load.failed() == [], load.failed()[:5]
        assert load.to(added["url"], after=removed_at) == 0
        assert not pid_alive(added["pid"])
        again = disagg("scale", "gen", "1", "--run-dir", str(run), cwd=tmp_path)
        assert again.returncode == 0 and "already 1 worker" in again.stdout
    finally:
        disagg("down", "--run-dir", str(run), cwd=tmp_path)


def _serve_by_hand(tmp_path, run, url: str, port: int) -> subprocess.Popen:
    """A gen worker an operator starts on the side: the deployment's keys and model name, --register."""
    model = str(tmp_path / "model")
    log = open(tmp_path / f"by-hand-{port}.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "disagg.cli", "serve", model, "--engine", "synthetic", "--role", "gen",
         "--port", str(port), "--num-frontends", "1", "--served-model-name", model, "--synthetic-decode-step-seconds",
         "0.01", "--cluster-key-file", str(run / "cluster.key"), "--worker-key-file", str(run / "worker.key"),
         "--register", url], stdout=log, stderr=log)


def _listed(url: str, worker_url: str) -> dict | None:
    workers = httpx.get(f"{url}/cluster_info", timeout=5).json()["workers"]
    return next((w for w in workers if w["url"] == worker_url), None)


def test_a_worker_started_by_hand_registers_serves_and_leaves_when_stopped_or_silent(tmp_path):
    url, config, run = _up(tmp_path, "by-hand", "{ctx: {instances: 1}, gen: {instances: 1}}",
                           health="{interval_seconds: 0.2, registration_ttl_seconds: 2}")
    port = free_port()
    worker_url = f"http://127.0.0.1:{port}"
    worker = _serve_by_hand(tmp_path, run, url, port)
    try:
        wait_until(lambda: (_listed(url, worker_url) or {}).get("healthy"), 90)
        with LoadLoop(url, str(tmp_path / "model")) as load:
            joined_at = time.monotonic()
            load.wait_for(30)
            assert load.to(worker_url, after=joined_at) > 0
            assert stop_process(worker, 40) == 0  # SIGTERM: it finishes what it holds, deregisters
            left_at = time.monotonic()
            assert _listed(url, worker_url) is None
            load.wait_for(20)
        assert load.failed() == [], load.failed()[:5]
        assert load.to(worker_url, after=left_at) == 0

        worker = _serve_by_hand(tmp_path, run, url, port)
        wait_until(lambda: (_listed(url, worker_url) or {}).get("healthy"), 90)
        worker.kill()  # no deregistration: its heartbeats stop, the TTL (2 s) drops it
        worker.wait()
        wait_until(lambda: _listed(url, worker_url) is None, 15)
    finally:
        stop_process(worker, 40)
        disagg("down", "--run-dir", str(run), cwd=tmp_path)


def _settings(url: str) -> dict:
    return httpx.get(f"{url}/settings", timeout=5).json()["settings"]


def _gen_workers(url: str, model: str, n: int, session: str | None = None, max_tokens: int = 2) -> list[str]:
    headers = {"x-session-id": session} if session else {}
    served = []
    for i in range(n):
        response = httpx.post(f"{url}/v1/completions", headers=headers, timeout=30,
                              json={"model": model, "prompt": f"route {i}", "max_tokens": max_tokens})
        assert response.status_code == 200, response.text
        served.append(response.headers["x-disagg-gen-worker"])
    return served


def test_reload_changes_the_routing_policy_and_a_timeout_and_refuses_a_bad_file(tmp_path):
    url, config, run = _up(tmp_path, "reload", "{ctx: {instances: 1}, gen: {instances: 2}}")
    model = str(tmp_path / "model")
    original = open(config).read()
    try:
        assert len(set(_gen_workers(url, model, 6, session="s1"))) == 2  # round robin: sessions ignored
        long = {"model": model, "prompt": "a long answer", "max_tokens": 150}  # 150 steps of 10 ms
        assert httpx.post(f"{url}/v1/completions", json=long, timeout=30).status_code == 200

        changed = original.replace("health: {interval_seconds: 0.2}",
                                   "health: {interval_seconds: 0.2}, gen_router: {policy: session}, "
                                   "timeouts: {request_seconds: 1.0}, log_level: debug")
        open(config, "w").write(changed)
        reload = disagg("reload", config, cwd=tmp_path)
        assert reload.returncode == 0, reload.stdout + reload.stderr
        assert "orchestrator.gen_router.policy: 'round_robin' -> 'session' (applied: 2 of 2" in reload.stdout
        assert "orchestrator.timeouts.request_seconds: 600.0 -> 1.0" in reload.stdout
        for _ in range(6):  # every process routes with it
            assert httpx.get(f"{url}/cluster_info").json()["gen_router"]["policy"] == "session"
        assert len(set(_gen_workers(url, model, 6, session="s1"))) == 1  # one session, one worker
        late = httpx.post(f"{url}/v1/completions", json=long, timeout=30)
        assert late.status_code == 504, late.text  # past the new whole-request timeout
        assert json.loads((run / "orchestrator.json").read_text())["gen_router"]["policy"] == "session"
        assert _settings(url)["log_level"] == "debug"

        bad = changed.replace("policy: session", "policy: fastest")
        open(config, "w").write(bad)
        refused = disagg("reload", "--run-dir", str(run), cwd=tmp_path)  # the file up read, re-read
        assert refused.returncode == 1 and "orchestrator.gen_router.policy" in refused.stderr, refused.stderr
        assert _settings(url)["gen_router"]["policy"] == "session"  # nothing changed
        assert _settings(url)["timeouts"]["request_seconds"] == 1.0

        restart = changed.replace("engine: {kind: synthetic", "engine: {kind: synthetic, max_num_seqs: 8") \
                         .replace("request_seconds: 1.0", "request_seconds: 30")
        open(config, "w").write(restart)
        supervisor = json.loads((run / "state.json").read_text())["supervisor_pid"]
        os.kill(supervisor, signal.SIGHUP)  # the same reload, from the supervisor's signal
        wait_until(lambda: _settings(url)["timeouts"]["request_seconds"] == 30, 10)
        wait_until(lambda: "engine.max_num_seqs: None -> 8 NEEDS A RESTART" in (run / "up.log").read_text(), 10)
        assert httpx.post(f"{url}/v1/completions", json=long, timeout=30).status_code == 200
        again = disagg("reload", "--run-dir", str(run), cwd=tmp_path)  # still not applied: said again
        assert again.returncode == 3 and "engine.max_num_seqs" in again.stdout, again.stdout + again.stderr
    finally:
        disagg("down", "--run-dir", str(run), cwd=tmp_path)
