"""Cores shared out between the torch engines of a local deployment (``engine.threads``).

torch gives every process one intra-op thread per core it may run on, and its OpenMP threads
spin for a while after each parallel region. Two engines on the same cores (a ctx and a gen
worker on a laptop) then each run a thread per core, and every step of one waits on threads
the other keeps busy: on 2 cores, concurrency 4 ran at a fraction of sequential speed per
request. So ``disagg up`` gives each torch engine on the machine an equal share of its cores.

``engine.threads`` (and a pool's ``engine.threads``):

- ``auto`` (the default): ``max(1, cores // torch engine ranks on this machine)``,
- ``torch``: leave the engine torch's default (every core),
- an integer: exactly that many.

Synthetic engines run no torch and take no share. Slurm deployments place workers on nodes
whose CPUs Slurm already divides; there ``auto`` leaves torch's default and an integer is passed on.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from orchestrator.typed import ConfigError

if TYPE_CHECKING:
    from disagg.deploy_config import DeployConfig

__all__ = ["THREADS_AUTO", "THREADS_TORCH", "validate_threads", "engine_threads", "available_cores"]

THREADS_AUTO = "auto"
THREADS_TORCH = "torch"


def validate_threads(value: int | str | None, key: str) -> None:
    if value is None or value in (THREADS_AUTO, THREADS_TORCH):
        return
    if isinstance(value, str) or value < 1:
        raise ConfigError(key, f"must be auto, torch or an integer >= 1, got {value!r}")


def available_cores() -> int:
    return len(os.sched_getaffinity(0))


def engine_threads(config: DeployConfig, cores: int) -> dict[str, int | None]:
    """``--engine-threads`` of each local worker, by process name (``ctx-0``, ``gen-0``, ...);
    None leaves torch's default."""
    pools = {"ctx": config.pools.ctx, "gen": config.pools.gen}
    torch_ranks = sum(pool.instances * pool.tensor_parallel_size for role, pool in pools.items()
                      if (config.engine_for(role).kind or "torch") == "torch")
    share = max(1, cores // max(1, torch_ranks))
    threads: dict[str, int | None] = {}
    for role, pool in pools.items():
        engine = config.engine_for(role)
        setting = engine.threads if engine.threads is not None else THREADS_AUTO
        if (engine.kind or "torch") != "torch" or setting == THREADS_TORCH:
            value = None
        else:
            value = share if setting == THREADS_AUTO else int(setting)
        threads.update({f"{role}-{index}": value for index in range(pool.instances)})
    return threads
