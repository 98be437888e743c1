"""`disagg down` while 16 streams are in flight cuts none of them (issue 16 item 9).

The orchestrator is stopped first; it drains (its grace_seconds, 30 s, as long as the
workers') while the workers, still up, finish the streams; then the workers stop.
"""

from __future__ import annotations

import json
import textwrap
import threading
import time

import httpx
import pytest

from test_up import alive, disagg
from worker_process import free_port


def _stream(url: str, model: str, results: list, started: threading.Event) -> None:
    body = {"model": model, "prompt": "once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
    try:
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/completions", json=body) as response:
            data = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data.append(line[6:])
                    started.set()
            results.append((response.status_code, data))
    except httpx.HTTPError as exc:
        results.append((type(exc).__name__, []))
        started.set()


@pytest.mark.slow
def test_down_under_load_cuts_no_stream(tmp_path):
    port = free_port()
    config = tmp_path / "drain.yaml"
    # 400 decode steps of 15 ms: ~6 s per stream, past the 5 s the orchestrator used to drain for.
    config.write_text(textwrap.dedent(f"""
        model: {tmp_path / "model"}
        tiny_model_size: test
        run_dir: {tmp_path / "run"}
        engine: {{kind: synthetic, synthetic_decode_step_seconds: 0.015}}
        orchestrator:
          port: {port}
          processes: 2
          health: {{interval_seconds: 0.2}}
          conditional: {{enabled: false}}
        pools:
          ctx: {{instances: 1, frontends: 1}}
          gen: {{instances: 1, frontends: 2}}
        startup_timeout_seconds: 90
    """))
    run = tmp_path / "run"
    up = disagg("up", str(config), cwd=tmp_path)
    assert up.returncode == 0, up.stdout + up.stderr
    state = json.loads((run / "state.json").read_text())
    pids = [state["supervisor_pid"], *(p["pid"] for p in state["processes"])]
    url = f"http://127.0.0.1:{port}"
    results: list = []
    started = [threading.Event() for _ in range(16)]
    threads = [threading.Thread(target=_stream, args=(url, str(tmp_path / "model"), results, event)) for event in started]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(30)
    begin = time.monotonic()
    down = disagg("down", "--run-dir", str(run), cwd=tmp_path)
    took = time.monotonic() - begin
    for thread in threads:
        thread.join(30)
    assert down.returncode == 0, down.stdout + down.stderr
    assert took < 45, f"down took {took:.1f} s"  # within the drain window, nothing SIGKILLed
    cut = [(status, data[-2:]) for status, data in results
           if status != 200 or data[-1:] != ["[DONE]"] or any('"error"' in d for d in data)]
    assert len(results) == 16 and not cut, cut
    assert not [pid for pid in pids if alive(pid)]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)
