"""disagg.deploy_plan: one plan per deployment file, executed by the local and the Slurm launcher alike."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from disagg.deploy_config import load_deploy_config
from disagg.deploy_plan import SLURM_RUN_DIR, local_plan, slurm_plan
from disagg.orchestrator_plan import main as setup_step
from orchestrator.config import OrchestratorSettings, StaticWorker, load_orchestrator_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
# What a launcher adds on its own: where the worker finds its key and state, how it logs, its cores.
LAUNCHER_FLAGS = {"--host", "--port", "--cluster-key-file", "--worker-key-file", "--state-dir", "--kv-host",
                  "--kv-port", "--log-level", "--engine-threads", "--tensor-parallel-size"}


def _serve_flags(argv: tuple[str, ...]) -> dict[str, str | None]:
    """``disagg serve``'s flags (the step wrapper before ``--`` dropped) minus the launcher's own."""
    serve = argv[argv.index("serve") + 2:]
    flags: dict[str, str | None] = {}
    for i, word in enumerate(serve):
        if word.startswith("--") and word not in LAUNCHER_FLAGS:
            value = serve[i + 1] if i + 1 < len(serve) and not serve[i + 1].startswith("--") else None
            flags[word] = value
    return flags


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_both_launchers_start_the_same_workers_with_the_same_settings(path, tmp_path):
    config = load_deploy_config(path)
    local, slurm = local_plan(config, tmp_path, tmp_path / "model"), slurm_plan(config, str(path))
    shape = [(w.name, w.pool, w.index, w.role, w.tensor_parallel_size) for w in local.workers]
    assert shape == [(w.name, w.pool, w.index, w.role, w.tensor_parallel_size) for w in slurm.workers]
    assert [w.name for w in local.workers] == [f"ctx-{i}" for i in range(config.pools.ctx.instances)] + \
        [f"gen-{i}" for i in range(config.pools.gen.instances)]
    for here, there in zip(local.workers, slurm.workers):
        assert _serve_flags(here.argv) == _serve_flags(there.argv), here.name
        assert there.argv[:7] == ("python", "-m", "slurm.step", "worker", "--run-dir", SLURM_RUN_DIR, "--")
        # Every worker of either requires the run dir's worker key, which the orchestrator presents.
        assert here.argv[here.argv.index("--worker-key-file") + 1] == str(tmp_path / "worker.key")
        assert there.argv[there.argv.index("--worker-key-file") + 1] == f"{SLURM_RUN_DIR}/worker.key"
        assert there.placement is not None and there.placement.name == there.name
    # The orchestrator: the same section, different discovery (static list here, registration there).
    differ = {"model_dir", "state_dir", "host", "port", "workers", "prometheus_targets_dir", "worker_key_file"}
    mine, theirs = (dataclasses.asdict(p.orchestrator.config) for p in (local, slurm))
    assert {k: v for k, v in mine.items() if k not in differ} == {k: v for k, v in theirs.items() if k not in differ}
    assert local.orchestrator.config.workers == tuple(StaticWorker(w.role, w.url) for w in local.workers)
    assert slurm.orchestrator.config.workers == ()
    assert local.orchestrator.config.worker_key_file == str((tmp_path / "worker.key").resolve())
    assert slurm.orchestrator.config.worker_key_file == f"{SLURM_RUN_DIR}/worker.key"


def test_every_setting_of_the_orchestrator_section_reaches_the_orchestrator(tmp_path):
    """The YAML's ``orchestrator:`` section is ``OrchestratorSettings``, declared once in
    ``orchestrator.config`` and the base of ``OrchestratorConfig``: each of its keys, set away from
    its default, arrives as written (the launcher's host and port aside)."""
    changed = {"processes": 3, "max_retries": 5, "api_key": "sk-test", "served_model_name": "named",
               "max_request_bytes": 4096, "max_upload_bytes": 8192, "max_concurrent_requests": 7,
               "max_queued_requests": 11, "max_queued_prompt_tokens": 13, "grace_seconds": 9.0,
               "max_process_restarts": 2, "process_restart_window_seconds": 60.0, "log_level": "debug",
               "ctx_router": {"policy": "least_load"}, "gen_router": {"policy": "kv_cache_aware"},
               "conditional": {"enabled": False}, "kv_pool": {"enabled": True},
               "health": {"interval_seconds": 2.5}, "timeouts": {"connect_seconds": 3.5}}
    path = tmp_path / "d.yaml"
    path.write_text(json.dumps({"model": "tiny", "orchestrator": changed}))
    config = load_deploy_config(path)
    settings = {f.name for f in dataclasses.fields(OrchestratorSettings)}
    assert settings - {"host", "port"} <= set(changed), "give every section key a non-default value above"
    orch = local_plan(config, tmp_path, tmp_path / "model").orchestrator.config
    for name in settings - {"host", "port"}:
        assert getattr(orch, name) == getattr(config.orchestrator, name) != getattr(OrchestratorSettings(), name), name


def test_a_local_plan_takes_the_fixed_ports_and_picks_free_ones_for_the_rest(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text("model: tiny\norchestrator: {port: 0}\npools: {ctx: {base_port: 9100, instances: 2}, gen: {}}\n")
    plan = local_plan(load_deploy_config(path), tmp_path, tmp_path / "model")
    assert [w.url for w in plan.workers][:2] == ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]
    assert plan.workers[2].port > 0 and plan.orchestrator.port > 0
    assert plan.orchestrator.argv[-2:] == ("--config", str(tmp_path / "orchestrator.json"))


def test_the_slurm_setup_step_writes_the_orchestrator_config_of_the_same_plan(tmp_path):
    model = tmp_path / "weights"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")  # what a model directory needs to be taken for one
    path = tmp_path / "d.yaml"
    path.write_text(f"model: {model}\nlauncher: slurm\norchestrator: {{port: 8123, processes: 3}}\n"
                    "pools: {ctx: {base_port: 9100}, gen: {base_port: 9200}}\n")
    config = load_deploy_config(path)
    with pytest.raises(ValueError, match="placeholder"):  # rendered before the job has a run dir
        slurm_plan(config, str(path)).write_orchestrator_config()
    run = tmp_path / "run"
    run.mkdir()
    assert setup_step([str(path), "--run-dir", str(run)]) == 0
    written = load_orchestrator_config(run / "orchestrator.json")
    assert written == slurm_plan(config, str(path), run_dir=str(run.resolve()), model=str(model)).orchestrator.config
    assert (written.port, written.processes, written.workers, written.model_dir) == (8123, 3, (), str(model))


def test_log_format_and_tracing_reach_every_process_of_both_launchers(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text("model: tiny\nlog_format: json\ntracing: {otlp_endpoint: 'http://127.0.0.1:4318', service_name: s}\n"
                    "pools: {ctx: {base_port: 9100}, gen: {base_port: 9200}}\n")
    config = load_deploy_config(path)
    for plan in (local_plan(config, tmp_path, tmp_path / "model"), slurm_plan(config, str(path))):
        for worker in plan.workers:
            flags = _serve_flags(worker.argv)
            assert flags["--log-format"] == "json" and flags["--otlp-endpoint"] == "http://127.0.0.1:4318"
            assert flags["--trace-service-name"] == f"s-{worker.pool}"
        orchestrator = plan.orchestrator.config
        assert orchestrator.log_format == "json" and orchestrator.tracing.otlp_endpoint == "http://127.0.0.1:4318"
    path.write_text("model: tiny\n")
    untraced = local_plan(load_deploy_config(path), tmp_path, tmp_path / "model")
    assert "--otlp-endpoint" not in untraced.workers[0].argv and "--log-format" in untraced.workers[0].argv


@pytest.mark.parametrize("yaml, key", [("log_format: xml", "log_format"),
                                       ("tracing: {otlp_endpoint: 'ftp://x'}", "tracing.otlp_endpoint"),
                                       ("tracing: {service_name: ''}", "tracing.service_name"),
                                       ("tracing: {sample_ratio: 2}", "tracing.sample_ratio"),
                                       ("tracing: {endpoint: 'http://x'}", "tracing.endpoint")])
def test_a_bad_log_or_tracing_setting_names_its_key(tmp_path, yaml, key):
    from workers.config import ConfigError

    path = tmp_path / "d.yaml"
    path.write_text(f"model: tiny\n{yaml}\n")
    with pytest.raises(ConfigError) as error:
        load_deploy_config(path)
    assert key in str(error.value)


def test_tracing_without_the_extra_installed_is_an_error_naming_the_key(tmp_path, monkeypatch):
    import importlib.util

    from workers.config import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("opentelemetry.sdk") else real(name, *a))
    path = tmp_path / "d.yaml"
    path.write_text("model: tiny\ntracing: {otlp_endpoint: 'http://127.0.0.1:4318'}\n")
    with pytest.raises(ConfigError, match=r"tracing.otlp_endpoint: .*pip install 'disagg\[tracing\]'"):
        load_deploy_config(path)
