"""The ``slurm:`` section of a deployment file: frozen, typed, errors that name the file and key.

Everything here becomes either an ``#SBATCH`` line or a line of the rendered
script; nothing is read from the environment. Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from common.config_errors import ConfigError
from orchestrator.typed import from_mapping

__all__ = ["CONTAINER_RUNTIMES", "ContainerConfig", "SlurmConfig", "parse_slurm_config", "ConfigError"]

# Slurm's --time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit.
_TIME_RE = re.compile(r"^(\d+-\d{1,2}(:\d{2}){0,2}|\d+(:\d{2}){0,2}|UNLIMITED|INFINITE)$")
# --mem: a size in megabytes, or with a K/M/G/T suffix; 0 means all of each node's memory.
_MEM_RE = re.compile(r"^\d+[KMGT]?$")
# Job names and partitions end up unquoted on #SBATCH lines: keep them to safe characters.
_NAME_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")
_PATH_RE = re.compile(r"^[A-Za-z0-9_./+-]+$")


CONTAINER_RUNTIMES = ("pyxis", "apptainer")


@dataclass(frozen=True)
class ContainerConfig:
    """Run every step, and the setup line before them, in a container image (containers/ builds one)."""

    image: str
    """pyxis: an enroot image, ``registry#repo:tag`` or a ``.sqsh`` path; apptainer: a ``.sif`` path
    (or any image reference ``apptainer exec`` takes)."""
    mounts: tuple[str, ...] = ()
    """``SRC:DST[:FLAGS]`` each; the run directory must be reachable at the same path inside."""
    runtime: str = "pyxis"
    """``pyxis``: ``srun --container-image`` (pyxis/enroot); ``apptainer``: each step's command runs
    under ``apptainer exec`` (``--nv`` on GPU nodes), mounts as ``--bind``."""

    def validate(self, prefix: str) -> None:
        if not self.image or any(c.isspace() for c in self.image):
            raise ConfigError(f"{prefix}.image", f"must be a non-empty image name without spaces, got {self.image!r}")
        for i, mount in enumerate(self.mounts):
            parts = mount.split(":")
            if not 2 <= len(parts) <= 3 or not parts[0] or not parts[1] or "," in mount:
                raise ConfigError(f"{prefix}.mounts[{i}]", f"must be SRC:DST[:FLAGS], got {mount!r}")
        if self.runtime not in CONTAINER_RUNTIMES:
            raise ConfigError(f"{prefix}.runtime",
                              f"must be one of {', '.join(CONTAINER_RUNTIMES)}, got {self.runtime!r}")


@dataclass(frozen=True)
class SlurmConfig:
    partition: str | None = None
    """None: the cluster's default partition."""
    account: str | None = None
    qos: str | None = None
    time_limit: str = "01:00:00"
    """Slurm's --time: MM, HH:MM:SS, D-HH:MM:SS, ... or UNLIMITED."""
    nodes: int = 1
    gpus_per_node: int = 0
    """GPUs each node has; placement packs workers into nodes by this. 0: CPU-only workers."""
    cpus_per_node: int | None = None
    """--cpus-per-task of the job's one task per node (None: Slurm's default)."""
    mem: str | None = None
    """--mem per node, e.g. 500G; "0" takes all of each node's memory."""
    job_name: str = "disagg"
    env_setup: str = ""
    """Shell lines run before any step (module loads, ``source venv/bin/activate``, exports)."""
    container: ContainerConfig | None = None
    extra_sbatch: tuple[str, ...] = ()
    """More sbatch options, each written as ``#SBATCH <line>`` (e.g. ``--exclusive``)."""
    run_root: str = "disagg-runs"
    """Where run directories are made, on a filesystem every node shares; relative paths are
    relative to the directory sbatch was called from. The run dir is <run_root>/<job_name>-<job id>."""

    def validate(self, prefix: str) -> None:
        for key in ("partition", "account", "qos"):
            value = getattr(self, key)
            if value is not None and not _NAME_RE.match(value):
                raise ConfigError(f"{prefix}.{key}", f"must be a plain name ([A-Za-z0-9_.+-]), got {value!r}")
        if not _NAME_RE.match(self.job_name):
            raise ConfigError(f"{prefix}.job_name", f"must be a plain name ([A-Za-z0-9_.+-]), got {self.job_name!r}")
        if not _TIME_RE.match(self.time_limit):
            raise ConfigError(f"{prefix}.time_limit",
                              f"must be a Slurm time (MM, HH:MM:SS, D-HH:MM:SS or UNLIMITED), got {self.time_limit!r}")
        if self.nodes < 1:
            raise ConfigError(f"{prefix}.nodes", f"must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise ConfigError(f"{prefix}.gpus_per_node", f"must be >= 0, got {self.gpus_per_node}")
        if self.cpus_per_node is not None and self.cpus_per_node < 1:
            raise ConfigError(f"{prefix}.cpus_per_node", f"must be >= 1, got {self.cpus_per_node}")
        if self.mem is not None and not _MEM_RE.match(self.mem):
            raise ConfigError(f"{prefix}.mem", f"must be a size like 500G, 64000M or 0, got {self.mem!r}")
        for i, line in enumerate(self.extra_sbatch):
            if not line.startswith("-") or "\n" in line:
                raise ConfigError(f"{prefix}.extra_sbatch[{i}]",
                                  f"must be one sbatch option such as --exclusive, got {line!r}")
        if not _PATH_RE.match(self.run_root):
            raise ConfigError(f"{prefix}.run_root",
                              f"must be a non-empty path of [A-Za-z0-9_./+-] (it is written unquoted), "
                              f"got {self.run_root!r}")


def parse_slurm_config(data: Any, source: str, prefix: str = "slurm") -> SlurmConfig:
    """``data`` is the mapping under ``slurm:`` in the file ``source``; errors read
    ``<source>: slurm.<key>: <message>``."""
    try:
        return from_mapping(SlurmConfig, data, prefix)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc.key}", str(exc)[len(exc.key) + 2:]) from None
