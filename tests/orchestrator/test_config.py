"""Deployment and orchestrator configs: typed, frozen, errors naming the file and the key."""

from __future__ import annotations

import dataclasses

import pytest

from disagg.deploy_config import load_deploy_config
from orchestrator.config import load_orchestrator_config
from workers.config import ConfigError


def write(tmp_path, text: str, name: str = "dep.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, key, message", [
    ("model: tiny\npools:\n  gen:\n    instances: 0\n", "pools.gen.instances", "must be >= 1, got 0"),
    ("model: tiny\norchestrator:\n  gen_router: {policy: random}\n", "orchestrator.gen_router.policy",
     "must be one of"),
    ("model: tiny\nengine:\n  kind: jax\n", "engine.kind", "must be torch or synthetic"),
    ("model: tiny\norchestrator:\n  grace_seconds: 0\n", "orchestrator.grace_seconds", "must be in (0, 3600]"),
    ("model: tiny\norchestrator:\n  max_concurrent_requests: -1\n", "orchestrator.max_concurrent_requests",
     "must be >= 0"),
    ("model: tiny\nengine:\n  perf_record_seconds: 0\n", "engine.perf_record_seconds", "must be > 0"),
    ("model: tiny\npools:\n  ctx:\n    engine: {max_num_seqs: many}\n", "pools.ctx.engine.max_num_seqs",
     "must be an integer"),
    ("model: tiny\norchestrator:\n  conditional: {min_cached_fraction: 1.5}\n",
     "orchestrator.conditional.min_cached_fraction", "must be in (0, 1]"),
    ("model: tiny\norchestrator: {port: 80, porrt: 1}\n", "orchestrator.porrt", "unknown key"),
    ("engine: {}\n", "model", "is required"),
    ("model: tiny\npools:\n  gen:\n    engine: {stream_interval: 0}\n", "pools.gen.engine.stream_interval",
     "must be in [1, 1024], got 0"),
])
def test_deploy_config_errors_name_file_and_key(tmp_path, text, key, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_deploy_config(path)
    assert info.value.key == f"{path}: {key}"
    assert message in str(info.value)


def test_deploy_config_defaults_overrides_and_frozen(tmp_path):
    path = write(tmp_path, "model: tiny\nengine: {kind: synthetic, block_size: 8}\n"
                           "pools:\n  gen: {instances: 2, frontends: 3, engine: {block_size: 32}}\n", "mine.yaml")
    config = load_deploy_config(path)
    assert config.name == "mine" and str(config.run_path) == ".disagg/mine"
    assert config.engine_for("gen").block_size == 32 and config.engine_for("gen").kind == "synthetic"
    assert config.engine_for("ctx").block_size == 8
    assert config.pools.gen.instances == 2 and config.pools.ctx.instances == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model = "x"
    assert str(load_deploy_config(path, run_dir="/tmp/r").run_path) == "/tmp/r"


def test_stream_interval_reaches_serve_per_pool(tmp_path):
    path = write(tmp_path, "model: tiny\nengine: {stream_interval: 4}\npools:\n  ctx: {engine: {stream_interval: 1}}\n")
    config = load_deploy_config(path)
    assert config.engine_for("gen").serve_options()["--stream-interval"] == 4
    assert config.engine_for("ctx").serve_options()["--stream-interval"] == 1


def test_shipped_local_yaml_is_valid():
    config = load_deploy_config("configs/local.yaml")
    assert config.pools.ctx.instances >= 1 and config.pools.gen.instances >= 1


def test_local_yaml_ctx_worker_prefills_about_one_prompt_a_step():
    """benchmarks/local_workload.py's prompts (~230 tokens with the chat template): the ctx budget
    holds one and not two, so concurrent prompts pipeline into gen instead of prefilling as one
    convoy; gen keeps the wide budget (its steps are decodes)."""
    config = load_deploy_config("configs/local.yaml")
    assert 230 <= config.engine_for("ctx").max_num_batched_tokens < 2 * 200
    assert config.engine_for("gen").max_num_batched_tokens == 1024


def test_orchestrator_config_errors(tmp_path):
    path = write(tmp_path, '{"model_dir": "/m", "state_dir": "/s", "workers": [{"role": "gen", "url": "x"}]}',
                 "o.json")
    with pytest.raises(ConfigError) as info:
        load_orchestrator_config(path)
    assert info.value.key == f"{path}: orchestrator.workers[0].url"
    path = write(tmp_path, '{"model_dir": "/m", "state_dir": "/s", "processes": 2}', "o.json")
    assert load_orchestrator_config(path).processes == 2


def test_orchestrator_drain_restart_limit_and_access_log_keys_reach_its_config(tmp_path):
    from disagg.deploy_config import render_flags
    from disagg.deploy_plan import orchestrator_config
    from disagg.deployment import STOP_SECONDS, orchestrator_stop_seconds

    config = load_deploy_config(write(tmp_path, "model: tiny\naccess_log: true\norchestrator:\n  grace_seconds: 45\n"
                                                "  max_process_restarts: 2\n  process_restart_window_seconds: 60\n"
                                                "  max_concurrent_requests: 100\n"))
    orch = orchestrator_config(config, model=tmp_path / "m", state_dir=tmp_path / "s", host="127.0.0.1", port=8000)
    assert (orch.grace_seconds, orch.max_process_restarts, orch.process_restart_window_seconds) == (45, 2, 60)
    assert orch.max_concurrent_requests == 100 and orch.access_log is True
    # The supervisor waits for the orchestrator at least as long as for the workers, and past its grace.
    assert orchestrator_stop_seconds(45) > 45 and orchestrator_stop_seconds(5) > STOP_SECONDS
    assert render_flags({"--access-log": True, "--port": 5, "--x": None}) == ["--access-log", "--port", "5"]
    defaults = load_deploy_config(write(tmp_path, "model: tiny\n", "plain.yaml"))
    assert defaults.orchestrator.grace_seconds == 30 and defaults.access_log is False
