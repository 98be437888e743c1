"""The launcher's side of a tensor-parallel engine: which ranks it starts, and their end.

``plan_ranks`` decides where the group's ranks come from. Without a
``RankEnv`` (``rank_env.from_environ()`` is None) the launcher spawns every
follower itself (``LocalFollowers``): rank 0 listens for them on 127.0.0.1 at
a free port, the worker's own HMAC key on the link. With one (an ``srun`` step started every rank), this is rank 0
and spawns nothing; its link key is derived from the cluster key, which every
rank of the step reads from its key file.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import random
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from common.processes import stop_processes
from workers.config import ConfigError, EngineConfig
from workers.ipc import write_private_file
from workers.rank_env import RankEnv

__all__ = ["RankPlan", "plan_ranks", "rank_link_key", "LocalFollowers", "free_port"]

log = logging.getLogger("disagg.launcher")

FOLLOWER_STOP_SECONDS = 5.0


def rank_link_key(cluster_key: bytes) -> bytes:
    """The rank link's key for externally started ranks: the cluster key, domain-separated."""
    return hmac.new(cluster_key, b"disagg tensor-parallel rank link", hashlib.sha256).digest()


@dataclass(frozen=True)
class RankPlan:
    ranks: RankEnv  # rank 0's view of the group
    spawn_followers: bool  # the launcher starts ranks 1..N-1 itself
    key: bytes  # the rank link's HMAC key


def plan_ranks(size: int, rank_env: RankEnv | None, worker_key: bytes, cluster_key: bytes | None) -> RankPlan | None:
    """None for a one-rank engine. ``rank_env`` is this process's (rank 0's) when ranks were
    started externally. Raises ConfigError naming the setting that does not fit."""
    if rank_env is not None:
        if rank_env.world_size != size and size != 1:
            raise ConfigError("tensor_parallel_size", f"{size}, but DISAGG_TP_SIZE says {rank_env.world_size}")
        if rank_env.world_size == 1:
            return None
        if cluster_key is None:
            raise ConfigError("cluster_key_file", "ranks started externally (DISAGG_TP_SIZE) authenticate their "
                                                  "link with the cluster key: pass --cluster-key-file")
        return RankPlan(rank_env, spawn_followers=False, key=rank_link_key(cluster_key))
    if size < 1:
        raise ConfigError("tensor_parallel_size", f"must be >= 1, got {size}")
    if size == 1:
        return None
    port = free_port("127.0.0.1")
    return RankPlan(RankEnv(rank=0, world_size=size, local_rank=0, master_addr="127.0.0.1", master_port=port),
                    spawn_followers=True, key=worker_key)


def free_port(host: str) -> int:
    """A port free now. Below the ephemeral range when one is free there, so that the sockets other
    processes open meanwhile (port 0 binds, outgoing connections) do not take it first."""
    for port in random.sample(range(20000, 32768), 50):
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class LocalFollowers:
    """Ranks 1..N-1 as children of the launcher, each with a 0600 spec file holding the key."""

    def __init__(self, plan: RankPlan, config: EngineConfig, spec_dir: Path, launcher_pid: int, log_flags: list[str],
                 start_child, disagg: Any = None) -> None:
        from workers.rank_follower import FollowerSpec

        self.children = []
        for rank in range(1, plan.ranks.world_size):
            env = msgspec.structs.replace(plan.ranks, rank=rank, local_rank=rank)
            spec_file = spec_dir / f"rank-{rank}.spec"
            write_private_file(spec_file, msgspec.json.encode(FollowerSpec(env, plan.key.hex(), config, disagg=disagg)))
            argv = [sys.executable, "-m", "workers.rank_follower", "--spec", str(spec_file),
                    "--launcher-pid", str(launcher_pid), *log_flags]
            self.children.append(start_child(f"tensor-parallel rank {rank}", argv))

    def exited(self) -> list[str]:
        """How each follower that has exited went."""
        return [child.describe_exit() for child in self.children if child.popen.poll() is not None]

    def stop(self) -> None:
        """SIGTERM all (rank 0 has normally told them to stop already), SIGKILL after a wait."""
        stop_processes([child.popen for child in self.children], FOLLOWER_STOP_SECONDS)
        for child in self.children:
            child.describe_exit()  # joins the output thread
