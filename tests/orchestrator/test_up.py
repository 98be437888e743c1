"""`disagg up` -> requests through the openai and anthropic clients -> `disagg status` / `logs` -> `disagg down` leaves nothing running."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time

import anthropic
import openai
from worker_process import free_port, port_is_free

from common.processes import pid_alive
from workers.engine.model.tiny import make_tiny_model


def disagg(*args: str, cwd, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disagg.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def write_deployment(tmp_path, name: str = "tiny", *, port: int = 0, run_dir: bool = True, processes: int = 1,
                     conditional: bool | None = False, gen_frontends: int = 1, engine: str = "",
                     extra: str = "") -> str:
    """A ctx and a gen worker (the pools' default roles) on the synthetic engine and the tiny test
    model (written to tmp_path/model here, served under that path); with ``conditional`` False both legs run
    for every request. ``run_dir`` False: the default one, ./.disagg/<name>; ``engine``: more engine
    keys (``, key: value``); ``extra``: more top-level YAML."""
    orchestrator = f"port: {port or free_port()}, processes: {processes}, health: {{interval_seconds: 0.2}}"
    if conditional is not None:
        orchestrator += f", conditional: {{enabled: {str(conditional).lower()}}}"
    config = tmp_path / f"{name}.yaml"
    if not (tmp_path / "model" / "config.json").exists():
        make_tiny_model(tmp_path / "model", size="test")
    config.write_text(textwrap.dedent(f"""\
        model: {tmp_path / "model"}
        {f"run_dir: {tmp_path / 'run'}" if run_dir else ""}
        engine: {{kind: synthetic{engine}}}
        orchestrator: {{{orchestrator}}}
        pools: {{ctx: {{instances: 1, frontends: 1}}, gen: {{instances: 1, frontends: {gen_frontends}}}}}
        startup_timeout_seconds: 90
    """) + textwrap.dedent(extra))
    return str(config)


def test_up_request_status_down(tmp_path):
    port = free_port()
    config = write_deployment(tmp_path, port=port, processes=2, gen_frontends=2)
    up = disagg("up", config, cwd=tmp_path)
    run = tmp_path / "run"
    try:
        assert up.returncode == 0, up.stdout + up.stderr + (run / "up.log").read_text()
        assert f"ready on http://127.0.0.1:{port}" in up.stdout
        state = json.loads((run / "state.json").read_text())
        pids = [state["supervisor_pid"], *(p["pid"] for p in state["processes"])]
        assert [p["name"] for p in state["processes"]] == ["ctx-0", "gen-0", "orchestrator"]
        assert stat.S_IMODE((run / "cluster.key").stat().st_mode) == 0o600

        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = str(tmp_path / "model")  # served under the id the YAML wrote
        assert [m.id for m in client.models.list().data] == [model]
        raw = client.completions.with_raw_response.create(model=model, prompt="hello there", max_tokens=3)
        assert raw.headers["x-disagg-mode"] == "disagg"  # a ctx leg, then a gen leg
        assert raw.parse().usage.completion_tokens == 3
        chunks = list(client.chat.completions.create(model=model, max_tokens=4, stream=True,
                                                     messages=[{"role": "user", "content": "hi"}]))
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        message = claude.messages.create(model=model, max_tokens=3, messages=[{"role": "user", "content": "hey"}])
        assert message.usage.output_tokens == 3 and message.stop_reason == "max_tokens"
        with claude.messages.stream(model=model, max_tokens=3,
                                    messages=[{"role": "user", "content": "hey you"}]) as stream:
            assert stream.get_final_message().usage.output_tokens == 3

        status = disagg("status", "--run-dir", str(run), cwd=tmp_path)
        assert status.returncode == 0, status.stdout + status.stderr
        assert status.stdout.count("running") == 4 and status.stdout.count(" healthy;") == 2
        logs = disagg("logs", "orchestrator", "--run-dir", str(run), cwd=tmp_path)
        assert logs.returncode == 0 and "ready on" in logs.stdout
    finally:  # even when an assertion failed: nothing may outlive the test
        down = disagg("down", "--run-dir", str(run), cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
    deadline = time.monotonic() + 10
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if pid_alive(pid)] == []
    assert port_is_free(port)
    # runtime files gone; logs and the workers' persistent state (Message Batches) kept
    assert sorted(p.name for p in run.iterdir()) == ["logs", "prometheus.yml", "up.log", "worker-state"]
    assert disagg("status", "--run-dir", str(run), cwd=tmp_path).returncode == 1


def _wait(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout:g} s"
        time.sleep(0.1)


def test_a_process_past_its_restart_budget_is_left_down_and_the_rest_keep_serving(tmp_path):
    port = free_port()
    config = write_deployment(tmp_path, "flaky", port=port, conditional=None,
                              extra="restarts: {max_restarts: 1, window_seconds: 600}\n")
    run = tmp_path / "run"
    up = disagg("up", config, cwd=tmp_path)
    try:
        assert up.returncode == 0, up.stdout + up.stderr + (run / "up.log").read_text()

        def ctx_pid() -> int:
            (ctx,) = [p for p in json.loads((run / "state.json").read_text())["processes"] if p["name"] == "ctx-0"]
            return ctx["pid"]

        first = ctx_pid()
        os.kill(first, 9)
        _wait(lambda: ctx_pid() != first, 10)  # restarted: one restart in the window
        second = ctx_pid()
        _wait(lambda: b"ready on" in (run / "logs" / "ctx-0.log").read_bytes().split(b"exited")[-1], 60)
        os.kill(second, 9)  # the second exit in the window: left down
        _wait(lambda: "leaving it down" in (run / "up.log").read_text(), 10)
        assert ctx_pid() == second and not pid_alive(second)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model=str(tmp_path / "model"), prompt="still serving", max_tokens=3)
        assert answer.usage.completion_tokens == 3  # on the gen worker alone
        status = disagg("status", "--run-dir", str(run), cwd=tmp_path)
        assert "LEFT DOWN: it exited 2 times within 600 s" in status.stdout, status.stdout
        assert "ctx-0.log" in status.stdout
    finally:
        down = disagg("down", "--run-dir", str(run), cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
    status = disagg("status", "--run-dir", str(run), cwd=tmp_path)
    assert status.returncode == 1 and "up.log" in status.stdout
