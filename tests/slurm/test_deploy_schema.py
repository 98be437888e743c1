"""The deployment YAML's Slurm parts: launcher, slurm section, per-pool placement."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from disagg.deploy_config import load_deploy_config
from slurm.config import SlurmConfig
from workers.config import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "dep.yaml"
    path.write_text(text)
    return path


def test_dsv4_yaml_places_fifteen_four_rank_workers_of_the_deepseek_v4_engine() -> None:
    config = load_deploy_config(REPO / "configs/dsv4.yaml")
    assert (config.model, config.tiny_model_arch, config.engine.kind) == ("tiny", "deepseek_v4", "torch")
    workers = config.placement()
    assert [w.name for w in workers] == [*(f"ctx-{i}" for i in range(11)), *(f"gen-{i}" for i in range(4))]
    assert [(w.nodes, w.num_tasks) for w in workers] == [((i,), 4) for i in range(15)]


def test_unknown_tiny_model_arch_is_refused_with_the_key(tmp_path: Path) -> None:
    path = _write(tmp_path, (REPO / "configs/dsv4.yaml").read_text().replace("arch: deepseek_v4", "arch: gpt2"))
    with pytest.raises(ConfigError) as info:
        load_deploy_config(path)
    assert info.value.key == f"{path}: tiny_model_arch"


def test_dsv4_synthetic_yaml_places_twelve_workers_of_tp_ranks() -> None:
    config = load_deploy_config(REPO / "configs/dsv4-synthetic.yaml")
    assert config.launcher == "slurm" and config.slurm.nodes == 15 and config.slurm.gpus_per_node == 4
    workers = config.placement()
    assert [w.name for w in workers] == [*(f"ctx-{i}" for i in range(11)), "gen-0"]
    assert [w.nodes for w in workers[:11]] == [(i,) for i in range(11)]
    assert workers[11].nodes == (11, 12, 13, 14) and workers[11].num_tasks == 16
    assert [(w.num_tasks, w.tasks_per_node) for w in workers[:11]] == [(4, 4)] * 11


def test_scaled_yaml_is_runnable_on_one_cpu_node() -> None:
    config = load_deploy_config(REPO / "configs/dsv4-scaled.yaml")
    assert config.slurm == SlurmConfig(nodes=1, job_name="dsv4-scaled", time_limit="30",
                                       env_setup=config.slurm.env_setup)
    assert [(w.name, w.port, w.frontends, w.gpus) for w in config.placement()] == [
        ("ctx-0", 18100, 2, ()), ("ctx-1", 18101, 2, ()), ("gen-0", 18200, 2, ())]


def test_placement_that_cannot_fit_shows_the_arithmetic(tmp_path: Path) -> None:
    text = (REPO / "configs/dsv4-synthetic.yaml").read_text().replace("nodes: 15", "nodes: 14")
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_deploy_config(path)
    assert str(info.value) == (f"{path}: slurm.nodes: 11 ctx workers x 4 GPUs + 1 gen workers x 16 GPUs = 60 GPUs "
                               f"do not fit 14 nodes x 4 GPUs per node = 56 GPUs")


@pytest.mark.parametrize(("text", "key", "message"), [
    ("model: tiny\nlauncher: k8s\n", "launcher", "must be local or slurm, got 'k8s'"),
    ("model: tiny\nslurm: {nodes: 0}\n", "slurm.nodes", "must be >= 1, got 0"),
    ("model: tiny\nslurm: {time_limit: soon}\n", "slurm.time_limit", "must be a Slurm time"),
    ("model: tiny\npools: {gen: {tensor_parallel_size: 0}}\n", "pools.gen.tensor_parallel_size", "must be >= 1"),
    ("model: tiny\npools: {ctx: {gpus_per_worker: -2}}\n", "pools.ctx.gpus_per_worker", "must be >= 0"),
    ("model: tiny\nlauncher: slurm\npools: {ctx: {base_port: 0}}\n", "pools.ctx.base_port",
     "on Slurm ports are fixed before the job starts"),
    ("model: tiny\nlauncher: slurm\norchestrator: {port: 9000}\n"
     "pools: {ctx: {base_port: 9000}, gen: {base_port: 9100}}\n",
     "orchestrator.port", "port 9000 is also ctx-0's"),
    ("model: tiny\nengine: {synthetic_decode_step_seconds: -1}\n", "engine.synthetic_decode_step_seconds",
     "must be >= 0"),
    ("model: tiny\npools: {gen: {engine: {decode_attention: flash}}}\n", "pools.gen.engine.decode_attention",
     "must be auto, native or sdpa, got 'flash'"),
    ("model: tiny\nengine: {kv_pull_timeout: 0}\n", "engine.kv_pull_timeout", "must be > 0, got 0"),
    ("model: tiny\ntool_call_parser: mistral\n", "tool_call_parser",
     "must be one of hermes, llama3_json, got 'mistral'"),
])
def test_errors_name_the_file_and_key(tmp_path: Path, text: str, key: str, message: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_deploy_config(path)
    assert info.value.key == f"{path}: {key}"
    assert message in str(info.value)


def test_render_cli_prints_the_script_and_refuses_bad_files(tmp_path: Path) -> None:
    ok = subprocess.run([sys.executable, "-m", "disagg.cli", "render", "configs/dsv4-scaled.yaml"], cwd=REPO,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"#!/bin/bash\n# disagg deployment 'dsv4-scaled' from {REPO}/configs/dsv4-scaled.yaml\n")
    assert ok.stdout.count("\nsrun ") == 4
    bad = subprocess.run([sys.executable, "-m", "disagg.cli", "render", str(_write(tmp_path, "model: tiny\nslurm: "
                                                                                  "{nodes: 0}\n"))],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == f"disagg render: {tmp_path / 'dep.yaml'}: slurm.nodes: must be >= 1, got 0\n"
