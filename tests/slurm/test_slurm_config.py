from __future__ import annotations

import pytest

from slurm.config import ContainerConfig, SlurmConfig, parse_slurm_config
from workers.config import ConfigError


def test_defaults_and_full_section() -> None:
    assert parse_slurm_config(None, "local.yaml") == SlurmConfig()
    cfg = parse_slurm_config({
        "partition": "batch", "account": "llm", "qos": "high", "time_limit": "1-12:00:00", "nodes": 15,
        "gpus_per_node": 4, "cpus_per_node": 64, "mem": "500G", "job_name": "dsv4",
        "env_setup": "module load cuda\n", "extra_sbatch": ["--exclusive"], "run_root": "/shared/runs",
        "container": {"image": "nvcr.io#nvidia/pytorch:24.05-py3", "mounts": ["/shared:/shared"]},
    }, "dsv4.yaml")
    assert cfg.nodes == 15 and cfg.gpus_per_node == 4 and cfg.extra_sbatch == ("--exclusive",)
    assert cfg.container == ContainerConfig(image="nvcr.io#nvidia/pytorch:24.05-py3", mounts=("/shared:/shared",))


@pytest.mark.parametrize(("data", "key", "words"), [
    ({"nodes": 0}, "slurm.nodes", "must be >= 1, got 0"),
    ({"nodes": "2"}, "slurm.nodes", "must be an integer"),
    ({"gpus_per_node": -1}, "slurm.gpus_per_node", "must be >= 0"),
    ({"time_limit": "2 hours"}, "slurm.time_limit", "must be a Slurm time"),
    ({"mem": "lots"}, "slurm.mem", "must be a size like 500G"),
    ({"partition": "a b"}, "slurm.partition", "must be a plain name"),
    ({"job_name": "x;rm"}, "slurm.job_name", "must be a plain name"),
    ({"extra_sbatch": ["exclusive"]}, "slurm.extra_sbatch[0]", "must be one sbatch option"),
    ({"run_root": "my runs"}, "slurm.run_root", "must be a non-empty path"),
    ({"container": {"image": "img", "mounts": ["/only-src"]}}, "slurm.container.mounts[0]", "SRC:DST[:FLAGS]"),
    ({"container": {"mounts": []}}, "slurm.container.image", "is required"),
    ({"container": {"image": "x.sif", "runtime": "docker"}}, "slurm.container.runtime",
     "must be one of pyxis, apptainer, got 'docker'"),
    ({"partitoin": "batch"}, "slurm.partitoin", "unknown key"),
])
def test_errors_name_the_file_and_key(data: dict, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_slurm_config(data, "configs/dsv4.yaml")
    assert info.value.key == f"configs/dsv4.yaml: {key}"
    assert str(info.value).startswith(f"configs/dsv4.yaml: {key}: ")
    assert words in str(info.value)


@pytest.mark.parametrize("time_limit", ["30", "30:00", "04:00:00", "2-00", "2-12:30", "1-00:00:00", "UNLIMITED"])
def test_slurm_time_formats(time_limit: str) -> None:
    assert parse_slurm_config({"time_limit": time_limit}, "f.yaml").time_limit == time_limit
