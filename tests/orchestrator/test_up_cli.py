"""`disagg up | status | logs | down` in scripts: plain lines into a pipe, a live line on a terminal,
one-line answers with nothing running, `status --json`, `logs -f`, logs after `down`."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time

from test_up import disagg, write_deployment

DISAGG = [sys.executable, "-m", "disagg.cli"]


def write_config(tmp_path, name: str, port: int = 0, gen_frontends: int = 1, extra: str = "") -> str:
    """A small synthetic deployment (both legs for every request) whose run dir is the default,
    ./.disagg/<name>; ``extra``: more top-level YAML."""
    return write_deployment(tmp_path, name, port=port, run_dir=False, gen_frontends=gen_frontends, extra=extra)


def test_with_nothing_running_each_command_answers_in_one_line(tmp_path):
    status = disagg("status", cwd=tmp_path)
    assert status.returncode == 1 and status.stdout == "no deployment running under ./.disagg\n", status
    as_json = json.loads(disagg("status", "--json", cwd=tmp_path).stdout)
    assert as_json["running"] is False and as_json["run_dir"] is None and "no deployment" in as_json["message"]
    down = disagg("down", cwd=tmp_path)
    assert down.returncode == 0 and down.stdout.splitlines()[0].startswith("disagg down: no deployment running")
    logs = disagg("logs", cwd=tmp_path)
    assert logs.returncode == 1 and logs.stdout == "" and len(logs.stderr.splitlines()) == 1


def _read_until(proc: subprocess.Popen, needle: str, timeout: float) -> str:
    seen = ""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        assert time.monotonic() < deadline, f"{needle!r} not in {seen!r}"
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            seen += os.read(proc.stdout.fileno(), 65536).decode(errors="replace")
    return seen


def test_up_into_a_pipe_status_json_logs_follow_down_twice_then_logs(tmp_path):
    config = write_config(tmp_path, "piped")
    up = disagg("up", config, cwd=tmp_path)
    run = tmp_path / ".disagg" / "piped"
    try:
        assert up.returncode == 0, up.stdout + up.stderr + (run / "up.log").read_text()
        assert "\r" not in up.stdout  # no terminal: no rewrites
        lines = up.stdout.splitlines()
        assert all(a != b for a, b in zip(lines, lines[1:])) and max(map(len, lines)) < 300, lines
        assert lines[-1].startswith("disagg up: ready on")

        status = disagg("status", "--json", cwd=tmp_path)
        assert status.returncode == 0, status.stderr
        view = json.loads(status.stdout)
        assert view["running"] is True and view["supervisor"]["state"] == "running"
        assert [(p["name"], p["state"]) for p in view["processes"]] == [
            ("ctx-0", "running"), ("gen-0", "running"), ("orchestrator", "running")]
        assert sorted(w["role"] for w in view["workers"]) == ["ctx", "gen"]
        assert view["prometheus_config"] == str(run.resolve() / "prometheus.yml")

        follow = subprocess.Popen([*DISAGG, "logs", "-f", "-n", "2"], cwd=tmp_path, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
        try:
            _read_until(follow, "[orchestrator] ", 20)  # the tails first, prefixed
            with open(run / "logs" / "ctx-0.log", "a") as log:
                log.write("appended while following\n")
            _read_until(follow, "[ctx-0] appended while following\n", 20)
        finally:
            follow.terminate()
        assert follow.wait(10) == 0
    finally:
        down = disagg("down", cwd=tmp_path)
    assert down.returncode == 0 and "stopped 3 processes" in down.stdout, down.stdout + down.stderr
    again = disagg("down", cwd=tmp_path)  # idempotent
    assert again.returncode == 0 and again.stdout.startswith("disagg down: no deployment running"), again
    logs = disagg("logs", cwd=tmp_path)  # the last run's logs are still on disk
    assert logs.returncode == 0 and "==> orchestrator <==" in logs.stdout and "last run" in logs.stderr
    one = disagg("logs", "ctx-0", cwd=tmp_path)
    assert "appended while following" in one.stdout


def test_up_on_a_terminal_rewrites_one_live_line(tmp_path):
    config = write_config(tmp_path, "tty")
    controller, terminal = pty.openpty()
    up = subprocess.Popen([*DISAGG, "up", config], cwd=tmp_path, stdout=terminal, stderr=terminal,
                          stdin=subprocess.DEVNULL)
    os.close(terminal)
    output = b""
    try:
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: every writer of the terminal closed it
                break
            if not chunk:
                break
            output += chunk
        assert up.wait(90) == 0, output
    finally:
        os.close(controller)
        down = disagg("down", cwd=tmp_path)
    text = output.decode(errors="replace")
    assert "\rdisagg up: starting" in text and "ready on" in text, text
    assert down.returncode == 0


def test_a_run_dir_elsewhere_is_found_by_the_bare_commands_as_up_said(tmp_path):
    work = tmp_path / "work"  # the directory the operator types in; the YAML puts the run dir beside it
    work.mkdir()
    config = write_deployment(tmp_path, "elsewhere")  # run_dir: <tmp_path>/run
    run = (tmp_path / "run").resolve()
    up = disagg("up", config, cwd=work)
    try:
        assert up.returncode == 0, up.stdout + up.stderr + (run / "up.log").read_text()
        assert up.stdout.splitlines()[-1].endswith("`disagg down` stops it)"), up.stdout
        assert (work / ".disagg" / "elsewhere").resolve() == run
        status = json.loads(disagg("status", "--json", cwd=work).stdout)
        assert status["running"] is True and status["run_dir"] == str(run)
        logs = disagg("logs", "orchestrator", cwd=work)
        assert logs.returncode == 0 and "ready" in logs.stdout, logs.stdout + logs.stderr
    finally:
        down = disagg("down", cwd=work)
    assert down.returncode == 0 and f"stopped 3 processes from {run}" in down.stdout, down.stdout + down.stderr
    assert not (run / "state.json").exists()
    after = disagg("logs", cwd=work)  # the last run's logs, through the link
    assert after.returncode == 0 and "==> orchestrator <==" in after.stdout and str(run) in after.stderr


def test_up_names_the_run_dir_when_the_default_place_is_taken(tmp_path):
    from disagg.run_dir_link import down_command, link_run_dir

    runs = tmp_path / ".disagg"
    (runs / "taken").mkdir(parents=True)  # an earlier run in the default place: never replaced
    assert link_run_dir(runs, "taken", tmp_path / "run") is False and not (runs / "taken").is_symlink()
    assert down_command(False, tmp_path / "run") == f"disagg down --run-dir {(tmp_path / 'run').resolve()}"
    assert link_run_dir(runs, "fresh", tmp_path / "run") is True  # a link, replaced by the next up's
    assert link_run_dir(runs, "fresh", tmp_path / "other") is True
    assert (runs / "fresh").resolve() == (tmp_path / "other").resolve()
    assert link_run_dir(runs, "taken", runs / "taken") is True  # the default place itself
    assert down_command(True, runs / "taken") == "disagg down"
