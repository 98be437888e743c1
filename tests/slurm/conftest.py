"""Slurm tests. Those marked ``slurm`` submit to a real cluster: CI brings one up with
``slurm/dev_cluster.sh up``; they are skipped only where ``sbatch`` is absent."""

from __future__ import annotations

import shutil
import subprocess

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
