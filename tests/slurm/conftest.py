"""Slurm tests. Those marked ``slurm`` submit to a real cluster: CI brings one up with
``slurm/dev_cluster.sh up``; they are skipped only where ``sbatch`` is absent."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

NO_SBATCH_REASON = "sbatch not found: start the dev cluster with `sudo slurm/dev_cluster.sh up` (CI does)"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slurm: submits jobs to a real Slurm cluster (slurm/dev_cluster.sh)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if shutil.which("sbatch") is not None:
        return
    skip = pytest.mark.skip(reason=NO_SBATCH_REASON)
    for item in items:
        if "slurm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def slurm_cluster() -> str:
    """The name of the idle node; fails (not skips) when sbatch exists but no cluster answers."""
    result = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=10)
    if result.returncode != 0 or not result.stdout.strip():
        pytest.fail(f"sbatch is installed but no Slurm answers (sinfo: {result.stderr.strip()}); "
                    f"run `slurm/dev_cluster.sh up`")
    return result.stdout.split()[0]


EMULATED_CONF = "/tmp/disagg-slurm-emu/slurm.conf"
EMULATED_NODES, EMULATED_GPUS = 4, 4
"""The least emulated cluster the tests need; a bigger one (the dsv4 benchmark's 15 x 4) serves too."""


def _emulated_shape(env: dict[str, str]) -> list[tuple[str, int]]:
    if not Path(env["SLURM_CONF"]).exists():
        return []  # sinfo would retry a missing slurm.conf for 60 s
    result = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %G %T"], capture_output=True, text=True, timeout=10,
                            env=env)
    nodes = []
    for line in result.stdout.splitlines() if result.returncode == 0 else []:
        name, gres, state = line.split()
        if state in ("idle", "mixed", "allocated"):
            nodes.append((name, int(gres.split(":")[-1]) if gres.startswith("gpu:") else 0))
    return nodes


@pytest.fixture(scope="session")
def emulated_cluster() -> dict[str, str]:
    """The environment (SLURM_CONF) of slurm/dev_cluster.sh's emulated multi-node cluster, with at least
    4 nodes of 4 fake GPUs; brought up here (as root) when none is. CI's .ci/run brings it up first."""
    env = {**os.environ, "SLURM_CONF": EMULATED_CONF}
    nodes = _emulated_shape(env)
    if len(nodes) < EMULATED_NODES or min(g for _, g in nodes) < EMULATED_GPUS:
        if os.geteuid() != 0:
            pytest.fail(f"no emulated cluster answers; run `sudo slurm/dev_cluster.sh up --nodes "
                        f"{EMULATED_NODES} --gpus-per-node {EMULATED_GPUS}`")
        script = Path(__file__).parents[2] / "slurm" / "dev_cluster.sh"
        up = subprocess.run([str(script), "up", "--nodes", str(EMULATED_NODES), "--gpus-per-node",
                             str(EMULATED_GPUS)], capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stderr
    return env
