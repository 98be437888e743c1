"""The alert rules (dashboards/alerts.yml) and the Grafana dashboard (dashboards/disagg.json), read against
the metrics the code really exports: promtool accepts the rules, every metric a rule or a panel names is
one that the worker and orchestrator registries render, and each panel's unit is its queries' unit.
(A real Prometheus evaluates them against a deployment in test_prometheus_dashboard.py.)"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_prometheus_dashboard import DASHBOARD, dashboard_panels, prometheus_tool

ALERTS = Path(__file__).resolve().parents[2] / "dashboards" / "alerts.yml"
_NAME = re.compile(r"\b((?:disagg|process)_[a-z0-9_]+)\b")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def exported_names() -> set[str]:
    """Every sample name a worker (frontend and launcher) and an orchestrator process render."""
    from frontends.prometheus import FrontendMetrics, LauncherMetrics
    from orchestrator.metrics import Metrics

    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    worker = FrontendMetrics(process="launcher")
    LauncherMetrics(worker.registry, {"role": "gen"})
    orchestrator = Metrics()
    orchestrator.observe("ttft", 0.1)  # a labelled histogram renders once a label value has been used
    texts = [worker.render(), orchestrator.render([("w-1", "http://127.0.0.1:1", "gen", True, False)])]
    names = set()
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            names.add(family.name)
            names.update(sample.name for sample in family.samples)
            names.update(f'{sample.name}{{le="{sample.labels["le"]}"}}' for sample in family.samples
                         if "le" in sample.labels)
    return names


def test_promtool_accepts_the_rules():
    result = subprocess.run([prometheus_tool("promtool"), "check", "rules", str(ALERTS)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_the_rules_cover_what_an_operator_is_paged_for():
    names = {rule["alert"] for rule in alert_rules()}
    assert {"DisaggWorkerDown", "DisaggHighErrorRatio", "DisaggTTFTBudgetBurnFast", "DisaggKVCacheFull",
            "DisaggFrontendLeftDown"} <= names
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]


def test_every_metric_a_rule_or_a_panel_names_is_exported():
    exported = exported_names()
    exprs = [rule["expr"] for rule in alert_rules()] + [expr for _, _, exprs in dashboard_panels() for expr in exprs]
    missing = {name for expr in exprs for name in _NAME.findall(expr)
               if name not in exported and name.removesuffix("_total") not in exported}
    assert not missing, f"named but never exported: {sorted(missing)}"
    # A bucket bound a rule reads (the TTFT SLO's 2.5 s) is one the histogram has.
    for expr in exprs:
        for bucket, le in re.findall(r'(\w+_bucket)\{[^}]*le="([^"]+)"', expr):
            assert f'{bucket}{{le="{le}"}}' in exported, (bucket, le)
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds",
                 "process_start_time_seconds", "disagg_build_info", "disagg_orchestrator_requests_in_flight",
                 "disagg_orchestrator_worker_healthy", "disagg_orchestrator_worker_degraded",
                 "disagg_orchestrator_client_disconnects_total"):
        assert name in exported


def query_unit(expr: str) -> str:
    """The Grafana unit a query's values are in, from the metrics it reads."""
    names = _NAME.findall(expr)
    if "histogram_quantile" in expr:
        (metric,) = {n for n in names if n.endswith("_bucket")}
        return {"_bytes_per_second_bucket": "Bps", "_seconds_bucket": "s"}[
            next(s for s in ("_bytes_per_second_bucket", "_seconds_bucket") if metric.endswith(s))]
    if any(n.endswith("_ratio") for n in names) or (" / " in expr and all(n.endswith("tokens_total") for n in names)):
        return "percentunit"
    if "rate(" in expr and any(n.endswith("_bytes_total") for n in names):
        return "Bps"
    if any(n.endswith("_bytes") for n in names):
        return "bytes"
    if "rate(" in expr and names == ["disagg_orchestrator_requests_total"]:
        return "reqps"
    return "short"


def test_each_panel_has_its_queries_unit():
    wrong = [(title, unit, expr, query_unit(expr)) for title, unit, exprs in dashboard_panels() for expr in exprs
             if query_unit(expr) != unit]
    assert not wrong, wrong


def test_the_unit_check_catches_seconds_on_a_bytes_axis():
    # The panel this check was written for: a seconds quantile on a bytes/s axis.
    assert query_unit('histogram_quantile(0.99, sum by (le) (rate(disagg_kv_transfer_seconds_bucket[1m])))') == "s"
    assert query_unit('histogram_quantile(0.5, sum by (le) (rate(disagg_kv_transfer_bytes_per_second_bucket'
                      '[1m])))') == "Bps"
    assert DASHBOARD.is_file()
