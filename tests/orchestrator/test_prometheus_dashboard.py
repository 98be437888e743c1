"""A real Prometheus scrapes a live local deployment through the prometheus.yml `disagg up` wrote:
every PromQL expression of the Grafana dashboard (dashboards/disagg.json) returns a series, none of them
NaN over the whole load, and every alert rule (dashboards/alerts.yml) evaluates without error."""

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
API_KEY = "scrape-with-this-key"  # the deployment has one: Prometheus presents it, and the worker key


def prometheus_tool(name: str = "prometheus") -> str:
    """The path of ``prometheus`` or ``promtool`` (both in Debian's prometheus package); under CI a
    missing one fails the test, elsewhere it skips."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed; .ci/run installs Debian's prometheus package")
        pytest.skip(f"{name} is not installed (apt-get install prometheus)")
    return path


def dashboard_panels() -> list[tuple[str, str, list[str]]]:
    """(title, unit, PromQL of each target) of every panel, Grafana's variables replaced."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], panel["fieldConfig"]["defaults"]["unit"],
             [target["expr"].replace("$__rate_interval", RATE_WINDOW).replace("$deployment", ".*")
              for target in panel["targets"]])
            for panel in dashboard["panels"]]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target."""
    return [(title, expr) for title, _, exprs in dashboard_panels() for expr in exprs]


def test_the_dashboard_has_the_panels_the_issue_names():
    titles = " | ".join(title.lower() for title, _ in dashboard_queries())
    for words in ("request rate", "time to first token", "inter-token", "end-to-end", "ctx and gen phase",
                  "kv transfer bytes", "kv cache usage", "prefix-cache hit rate", "queue depth", "retries and errors",
                  "frontends per worker"):
        assert words in titles


def _send_load(port: int, model: str) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)
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


def _up(prom: str) -> list[dict]:
    try:
        return _query(prom, 'up{job=~"disagg-.*"} == 1')
    except (httpx.HTTPError, ValueError):  # not listening yet, or 503 "Service Unavailable" while it starts
        return []


def _nan_series(prom: str, expr: str, start: float, end: float) -> list[dict]:
    """The series of ``expr`` that are NaN at every step from ``start`` to ``end`` (a panel line
    that never draws: e.g. a latency quantile of a role that never observes it)."""
    answer = httpx.get(f"{prom}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": 1},
                       timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    return [s["metric"] for s in answer["data"]["result"] if all(v == "NaN" for _, v in s["values"])]


def _with_alert_rules(config: Path, tmp_path: Path) -> Path:
    """``disagg up``'s prometheus.yml with the repository's alert rules loaded, as docs/operations.md says."""
    from test_alert_rules import ALERTS

    path = tmp_path / "prometheus-with-alerts.yml"
    path.write_text(config.read_text() + f"rule_files:\n  - {ALERTS}\n")
    return path


def _rules_evaluated(prom: str) -> list[dict]:
    """Every alert rule Prometheus loaded, once each has been evaluated (health ok or err)."""
    rules = [rule for group in httpx.get(f"{prom}/api/v1/rules", timeout=10).json()["data"]["groups"]
             for rule in group["rules"]]
    return rules if rules and all(rule["health"] != "unknown" for rule in rules) else []


@pytest.mark.slow
def test_prometheus_scrapes_the_deployment_and_every_dashboard_query_has_a_series(tmp_path):
    binary = prometheus_tool()
    port, prom_port = free_port(), free_port()
    config = write_config(tmp_path, "scraped", port, gen_frontends=2,
                          extra="prometheus: {scrape_interval_seconds: 1}\n")
    Path(config).write_text(Path(config).read_text().replace("processes: 1,", f"processes: 1, api_key: {API_KEY},"))
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
        assert "--web.listen-address=127.0.0.1:9090" in status.stdout

        prometheus = subprocess.Popen(
            [binary, f"--config.file={_with_alert_rules(run / 'prometheus.yml', tmp_path)}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
        prom = f"http://127.0.0.1:{prom_port}"
        deadline = time.monotonic() + 60
        while len(_up(prom)) < 3:  # scraped once before the load: the load's rates have a start
            assert prometheus.poll() is None and time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-3000:]
            time.sleep(0.5)
        load_start = time.time()
        # Two rounds a few scrapes apart: every histogram's series has an increase to take a quantile of.
        _send_load(port, str(tmp_path / "model"))
        time.sleep(3)
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
        nan = [(title, expr, series) for title, expr in queries
               for series in _nan_series(prom, expr, load_start, time.time())]
        assert not nan, f"series NaN over the whole load: {nan}"

        from test_alert_rules import alert_rules  # (that module imports this one)

        # The alert rules: each evaluated against this deployment without error; none fires.
        deadline = time.monotonic() + 30
        while not (rules := _rules_evaluated(prom)):
            assert time.monotonic() < deadline, "Prometheus did not evaluate the alert rules"
            time.sleep(1)
        assert len(rules) == len(alert_rules())
        assert [(r["name"], r["lastError"]) for r in rules if r["health"] != "ok"] == []
        assert [r["name"] for r in rules if r["state"] != "inactive"] == []
        for rule in alert_rules():
            _query(prom, rule["expr"])  # parses and runs as an instant query too
        # What the worker and frontend-left-down rules read exists, one series per worker, healthy.
        health = {s["metric"]["worker_role"]: s["value"][1] for s in _query(prom, "disagg_orchestrator_worker_healthy")}
        assert health == {"ctx": "1", "gen": "1"}
        degraded = {s["metric"]["worker_role"]: s["value"][1]
                    for s in _query(prom, "disagg_orchestrator_worker_degraded")}
        assert degraded == {"ctx": "0", "gen": "0"}
        # process_* of every process: orchestrator, and per worker its launcher, engine and frontends.
        processes = sorted((s["metric"]["job"], s["metric"]["process"])
                           for s in _query(prom, "process_resident_memory_bytes"))
        assert processes.count(("disagg-orchestrator", "orchestrator")) >= 1
        assert processes.count(("disagg-workers", "launcher")) == 2 and processes.count(("disagg-workers", "engine")) == 2
        assert processes.count(("disagg-workers", "frontend")) == 1  # the gen worker's second frontend
        info = _query(prom, "disagg_build_info")
        assert {s["metric"]["job"] for s in info} == {"disagg-orchestrator", "disagg-workers"}
        assert all(s["metric"]["version"] and s["metric"]["commit"] for s in info)
        # The orchestrator answers the same text on /metrics, where scrapers look by default.
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 401  # scrapers present the key
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
        assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain")
        assert "disagg_orchestrator_requests_total" in text.text
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(30)
        down = disagg("down", "--run-dir", str(run), cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not (run / "prometheus" / "targets").exists()  # nothing left to scrape
