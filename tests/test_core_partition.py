"""``engine.threads``: a local deployment shares the machine's cores out between its torch engines."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from disagg.core_partition import engine_threads
from disagg.deploy_config import load_deploy_config
from disagg.deploy_plan import local_plan
from orchestrator.typed import ConfigError

LOCAL = Path(__file__).resolve().parents[1] / "configs" / "local.yaml"


def config_with(tmp_path: Path, **changes):
    data = yaml.safe_load(LOCAL.read_text())
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_deploy_config(path)


@pytest.mark.parametrize("cores, share", [(1, 1), (2, 1), (3, 1), (16, 8)])
def test_auto_shares_cores_between_the_torch_engines(tmp_path, cores, share):
    assert engine_threads(config_with(tmp_path), cores) == {"ctx-0": share, "gen-0": share}


def test_more_instances_take_smaller_shares(tmp_path):
    config = config_with(tmp_path, pools__gen__instances=3)
    assert engine_threads(config, 16) == {"ctx-0": 4, "gen-0": 4, "gen-1": 4, "gen-2": 4}


def test_synthetic_engines_take_no_share_and_torch_keeps_the_default(tmp_path):
    config = config_with(tmp_path, pools__ctx__engine={"kind": "synthetic"})
    assert engine_threads(config, 8) == {"ctx-0": None, "gen-0": 8}
    assert engine_threads(config_with(tmp_path, engine__threads="torch"), 8) == {"ctx-0": None, "gen-0": None}
    assert engine_threads(config_with(tmp_path, engine__threads=3, pools__gen__engine={"threads": 1}), 8) == \
        {"ctx-0": 3, "gen-0": 1}


@pytest.mark.parametrize("value", ["many", 0, -2])
def test_bad_threads_name_the_key(tmp_path, value):
    with pytest.raises(ConfigError, match=r"deploy.yaml: engine.threads: must be auto, torch or an integer >= 1"):
        config_with(tmp_path, engine__threads=value)


def test_up_passes_the_share_to_each_worker(tmp_path):
    config = config_with(tmp_path)
    ctx, gen = local_plan(config, tmp_path, tmp_path / "model", engine_threads(config, 2)).workers
    assert gen.name == "gen-0" and gen.argv[gen.argv.index("--engine-threads") + 1] == "1"
    config = config_with(tmp_path, engine__threads="torch")
    for worker in local_plan(config, tmp_path, tmp_path / "model", engine_threads(config, 2)).workers:
        assert "--engine-threads" not in worker.argv


def test_the_engine_applies_its_thread_count(tiny_model_dir):
    from workers.config import EngineConfig
    from workers.engine.model_runner import ModelRunner

    before = torch.get_num_threads()
    try:
        ModelRunner(EngineConfig(model=str(tiny_model_dir), device="cpu", num_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
