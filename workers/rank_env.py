"""Where one tensor-parallel engine rank stands: the ``DISAGG_TP_*`` variables.

A worker of tensor-parallel size N is N engine ranks. Locally the launcher
spawns all of them; under Slurm every task of an ``srun --ntasks=N`` step runs
the same ``disagg serve`` command line, and ``slurm/step.py`` exports these
variables (from mpi4py or Slurm) before it execs it, so each process knows
which rank it is:

=========================  ==============================================
``DISAGG_TP_SIZE``         N, the tensor-parallel size (unset: no ranks
                           were started externally; the launcher spawns
                           them itself)
``DISAGG_TP_RANK``         this process's rank, 0 .. N-1
``DISAGG_TP_LOCAL_RANK``   its index among the ranks on its node (picks
                           the CUDA device)
``DISAGG_TP_MASTER_ADDR``  the host rank 0 listens on for its followers
``DISAGG_TP_MASTER_PORT``  the port rank 0 listens on for its followers
=========================  ==============================================

That one port is all a group needs fixed in advance: rank 0 hosts the
torch.distributed store on a port it binds itself and tells the followers
over that connection (``RankWelcome``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import msgspec

__all__ = ["RankEnv", "from_environ", "RANK_VARS"]

RANK_VAR = "DISAGG_TP_RANK"
SIZE_VAR = "DISAGG_TP_SIZE"
LOCAL_RANK_VAR = "DISAGG_TP_LOCAL_RANK"
MASTER_ADDR_VAR = "DISAGG_TP_MASTER_ADDR"
MASTER_PORT_VAR = "DISAGG_TP_MASTER_PORT"
RANK_VARS = (RANK_VAR, SIZE_VAR, LOCAL_RANK_VAR, MASTER_ADDR_VAR, MASTER_PORT_VAR)


class RankEnv(msgspec.Struct, frozen=True):
    """One engine rank's place in its tensor-parallel group."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @property
    def is_leader(self) -> bool:
        """Rank 0 runs the launcher, the frontends and the scheduler."""
        return self.rank == 0

    def to_environ(self) -> dict[str, str]:
        """The variables that make ``from_environ`` return this RankEnv."""
        return {
            RANK_VAR: str(self.rank), SIZE_VAR: str(self.world_size), LOCAL_RANK_VAR: str(self.local_rank),
            MASTER_ADDR_VAR: self.master_addr, MASTER_PORT_VAR: str(self.master_port),
        }


def _int_var(environ: Mapping[str, str], name: str, lo: int, hi: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        raise ValueError(f"{name}: required when {SIZE_VAR} is set")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {raw!r}") from None
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}: expected {bound}, got {value}")
    return value


def from_environ(environ: Mapping[str, str] = os.environ) -> RankEnv | None:
    """This process's RankEnv, or None when ``DISAGG_TP_SIZE`` is unset.

    Raises ValueError naming the variable that is missing or out of range.
    """
    if environ.get(SIZE_VAR) is None:
        return None
    world_size = _int_var(environ, SIZE_VAR, 1)
    rank = _int_var(environ, RANK_VAR, 0, world_size - 1)
    local_rank = _int_var(environ, LOCAL_RANK_VAR, 0, world_size - 1)
    addr = environ.get(MASTER_ADDR_VAR, "").strip()
    if not addr:
        raise ValueError(f"{MASTER_ADDR_VAR}: required when {SIZE_VAR} is set")
    port = _int_var(environ, MASTER_PORT_VAR, 1, 65535)
    return RankEnv(rank=rank, world_size=world_size, local_rank=local_rank, master_addr=addr, master_port=port)
