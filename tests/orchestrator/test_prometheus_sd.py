"""The Prometheus target files orchestrator process 0 keeps: every worker it knows, rewritten atomically
when one registers, leaves or comes back elsewhere, and only then; emptied at shutdown."""

from __future__ import annotations

import json

import yaml

from orchestrator.config import OrchestratorConfig, StaticWorker
from orchestrator.prometheus_sd import TargetFiles, prometheus_command, render_prometheus_config
from orchestrator.state import StateOwner


def _groups(path) -> list[dict]:
    return json.loads(path.read_text())


def test_registered_workers_join_and_leave_the_target_file(tmp_path):
    targets = TargetFiles(tmp_path / "targets", "0.0.0.0", 8000)
    config = OrchestratorConfig(model_dir="m", state_dir=str(tmp_path / "state"),
                                workers=(StaticWorker("ctx", "http://10.0.0.1:8100"),))
    owner = StateOwner(config, targets.update)
    workers = tmp_path / "targets" / "workers.json"
    assert _groups(workers) == [{"targets": ["10.0.0.1:8100"], "labels": {"role": "ctx", "worker": "static-0"}}]
    (orchestrator,) = _groups(tmp_path / "targets" / "orchestrator.json")
    assert orchestrator["labels"] == {"role": "orchestrator"}
    assert orchestrator["targets"][0].endswith(":8000") and not orchestrator["targets"][0].startswith("0.0.0.0")

    record = owner.registry.register("gen", "https://node7:9000/", "tcp://node7:5555")
    owner.notify()
    assert _groups(workers)[1] == {"targets": ["node7:9000"],
                                   "labels": {"role": "gen", "worker": record.worker_id, "__scheme__": "https"}}

    before = workers.stat().st_mtime_ns, workers.stat().st_ino
    owner.set_loads(0, {record.worker_id: [1, 10]})  # a load change: the registry is the same, no rewrite
    owner.registry.heartbeat(record.worker_id)
    owner.notify()
    assert (workers.stat().st_mtime_ns, workers.stat().st_ino) == before

    owner.registry.deregister(record.worker_id)
    owner.notify()
    assert [g["labels"]["worker"] for g in _groups(workers)] == ["static-0"]
    assert sorted(p.name for p in (tmp_path / "targets").iterdir()) == ["orchestrator.json", "workers.json"]

    targets.clear()
    assert _groups(workers) == [] and _groups(tmp_path / "targets" / "orchestrator.json") == []


def test_the_prometheus_config_points_at_the_target_files(tmp_path):
    config = yaml.safe_load(render_prometheus_config(tmp_path, "local", 2.5))
    assert config["global"]["scrape_interval"] == "2.5s"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert sorted(jobs) == ["disagg-orchestrator", "disagg-workers"]
    for job, file in (("disagg-orchestrator", "orchestrator.json"), ("disagg-workers", "workers.json")):
        assert jobs[job]["metrics_path"] == "/prometheus/metrics"
        assert jobs[job]["file_sd_configs"][0]["files"] == [str(tmp_path.resolve() / "prometheus/targets" / file)]
        assert jobs[job]["relabel_configs"] == [{"target_label": "deployment", "replacement": "local"}]


def test_the_suggested_prometheus_listens_on_loopback_only(tmp_path):
    # Prometheus's own default is 0.0.0.0:9090: its UI and API open to the whole network.
    command = prometheus_command(tmp_path)
    assert "--web.listen-address=127.0.0.1:9090" in command and "0.0.0.0" not in command
    assert f"--config.file={tmp_path.resolve() / 'prometheus.yml'}" in command
