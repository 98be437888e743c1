"""A real Prometheus scrapes a live local deployment through the prometheus.yml `disagg up` wrote,
and every PromQL expression of the Grafana dashboard (dashboards/disagg.json) returns a series."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from test_up import disagg
from test_up_cli import write_config
from worker_process import free_port

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "disagg.json"
RATE_WINDOW = "30s"  # Grafana's $__rate_interval: wide enough for several 1 s scrapes


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed; .ci/run installs Debian's package")
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    return path


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, Grafana's variables replaced."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"].replace("$__rate_interval", RATE_WINDOW).replace("$deployment", ".*"))
            for panel in dashboard["panels"] for target in panel["targets"]]


def test_the_dashboard_has_the_panels_the_issue_names():
    titles = " | ".join(title.lower() for title, _ in dashboard_queries())
    for words in ("request rate", "time to first token", "inter-token", "end-to-end", "ctx and gen phase",
                  "kv transfer bytes", "kv cache usage", "prefix-cache hit rate", "queue depth", "retries and errors",
                  "frontends per worker"):
        assert words in titles


def _send_load(port: int, model: str) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    system = "You are a careful assistant. " * 8  # the same prefix every time: prefix-cache hits
    for turn in range(6):
        chunks = list(client.chat.completions.create(
            model=model, max_tokens=6, stream=True,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"question {turn}"}]))
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        answer = client.completions.create(model=model, prompt=system + f"complete {turn}", max_tokens=4)
        assert answer.usage.completion_tokens == 4


def _query(prom: str, expr: str) -> list[dict]:
    answer = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


@pytest.mark.slow
def test_prometheus_scrapes_the_deployment_and_every_dashboard_query_has_a_series(tmp_path):
    binary = prometheus_binary()
    port, prom_port = free_port(), free_port()
    config = write_config(tmp_path, "scraped", port, gen_frontends=2,
                          extra="prometheus: {scrape_interval_seconds: 1}\n")
    run = tmp_path / ".disagg" / "scraped"
    up = disagg("up", config, cwd=tmp_path)
    prometheus = None
    try:
        assert up.returncode == 0, up.stdout + up.stderr + (run / "up.log").read_text()
        targets = run / "prometheus" / "targets"
        workers = json.loads((targets / "workers.json").read_text())
        assert sorted(group["labels"]["role"] for group in workers) == ["ctx", "gen"]
        assert json.loads((targets / "orchestrator.json").read_text())[0]["targets"] == [f"127.0.0.1:{port}"]
        status = disagg("status", "--run-dir", str(run), cwd=tmp_path)
        assert f"--config.file={run.resolve() / 'prometheus.yml'}" in status.stdout

        prometheus = subprocess.Popen(
            [binary, f"--config.file={run / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
        prom = f"http://127.0.0.1:{prom_port}"
        _send_load(port, str(tmp_path / "model"))

        queries = dashboard_queries()
        deadline = time.monotonic() + 60
        while True:  # a few scrapes after the load: every query has its series
            assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                empty = [(title, expr) for title, expr in queries if not _query(prom, expr)]
            except httpx.HTTPError:
                empty = queries
            if not empty:
                break
            assert time.monotonic() < deadline, f"queries without a series: {empty}"
            time.sleep(1)
        up_series = _query(prom, 'up{job=~"disagg-.*"}')
        assert len(up_series) == 3 and all(s["value"][1] == "1" for s in up_series)
        assert {s["metric"]["deployment"] for s in up_series} == {"scraped"}  # the dashboard's variable
        frontends = {s["metric"]["role"]: s["value"][1] for s in _query(prom, "sum by (role) (disagg_frontends)")}
        assert frontends == {"ctx": "1", "gen": "2"}
        kv_bytes = _query(prom, "sum(disagg_kv_transfer_bytes_total)")
        assert float(kv_bytes[0]["value"][1]) > 0  # every request had a ctx leg: KV moved
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(30)
        down = disagg("down", "--run-dir", str(run), cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not (run / "prometheus" / "targets").exists()  # nothing left to scrape
