"""Which tensor-parallel rank an ``srun`` task is, and where rank 0 listens for the others.

Every task of a worker's step (``srun --mpi=pmix --ntasks=N``) runs ``python -m slurm.step
worker``, which calls ``discover_rank`` and exports the result as the ``DISAGG_TP_*``
variables (``workers.rank_env`` reads them) before it execs ``disagg serve``:

- Under MPI (``PMIX_RANK`` or ``OMPI_COMM_WORLD_RANK`` set) through mpi4py: rank and size
  from ``COMM_WORLD``; rank 0 picks two free consecutive ports (the follower port and the
  torch.distributed store on port + 1) and broadcasts its address; every rank's node comes
  from an allgather. MPI is finalized before the exec: the ranks do not use it afterwards.
- Without MPI: ``SLURM_PROCID``/``SLURM_NTASKS``, and rank 0 publishes its address in the
  run directory (every node shares it), where the others poll for it.

Ranks are grouped into nodes by ``SLURMD_NODENAME``, never by host name: every node of the
emulated cluster (slurm/dev_cluster.sh) is this one machine with one host name.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TaskRank", "discover_rank", "rank_environ", "write_rank_table", "read_rank_table", "RANKS_DIR",
           "free_port_pair"]

RANKS_DIR = "ranks"
"""<run dir>/ranks/<worker>.json: the worker's ranks and their nodes (``disagg status`` shows them);
<run dir>/ranks/<job>.<step>.addr: rank 0's address for ranks that have no MPI."""
_POLL_SECONDS = 0.1
_ADDRESS_TIMEOUT = 120.0
_MPI_TIMEOUT = 60.0
_ALARM_MARGIN = 5.0
"""A rank whose MPI start and two collectives take longer exits (and srun --kill-on-bad-exit ends
the step): a worker that cannot form its group fails with a log line instead of hanging."""
# The Open MPI wheel's PMIx has neither Slurm's munge security module nor its ds12/ds21 stores:
# with slurmd's values every rank prints "find-available:not-valid" twice before falling back.
_PMIX_OVERRIDES = {"PMIX_SECURITY_MODE": "native", "PMIX_GDS_MODULE": "hash"}
# Two tiny collectives need no shared-memory transport, and Open MPI names its shared-memory
# segments after the host name, which every emulated node shares: TCP only, unless set.
_MPI_DEFAULTS = {"OMPI_MCA_btl": "self,tcp"}


@dataclass(frozen=True)
class TaskRank:
    rank: int
    world_size: int
    local_rank: int
    """Index among the ranks on this node (picks the device among CUDA_VISIBLE_DEVICES)."""
    master_addr: str
    master_port: int
    nodes: tuple[str, ...]
    """Every rank's node (SLURMD_NODENAME), by rank; only rank 0 needs to know them all."""
    via: str
    """mpi or slurm: how the rank was found."""


def rank_environ(rank: TaskRank) -> dict[str, str]:
    """The variables of the contract with ``workers.rank_env``."""
    return {"DISAGG_TP_RANK": str(rank.rank), "DISAGG_TP_SIZE": str(rank.world_size),
            "DISAGG_TP_LOCAL_RANK": str(rank.local_rank), "DISAGG_TP_MASTER_ADDR": rank.master_addr,
            "DISAGG_TP_MASTER_PORT": str(rank.master_port)}


def discover_rank(run_dir: Path, environ: Mapping[str, str] = os.environ) -> TaskRank:
    if "PMIX_RANK" in environ or "OMPI_COMM_WORLD_RANK" in environ:
        return _from_mpi(environ)
    return _from_slurm(run_dir, environ)


def free_port_pair(host: str = "") -> int:
    """A port p such that p and p + 1 were both free just now (the follower port and the torch store)."""
    while True:
        with socket.socket() as first:
            first.bind((host, 0))
            port = first.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind((host, port + 1))
                except OSError:
                    continue
            return port


def _node(environ: Mapping[str, str]) -> str:
    return environ.get("SLURMD_NODENAME") or socket.gethostname()


def _from_mpi(environ: Mapping[str, str]) -> TaskRank:
    os.environ.update(_PMIX_OVERRIDES)
    for key, value in _MPI_DEFAULTS.items():
        os.environ.setdefault(key, value)
    phase = ["MPI_Init"]  # where the main thread is, for the watchdog's message
    watchdog = threading.Timer(_MPI_TIMEOUT, _give_up, args=(environ, phase))
    watchdog.daemon = True
    watchdog.start()
    # MPI_Init can hold the GIL while it waits in a PMIx fence, so the thread above never runs:
    # SIGALRM at its default action ends the task from the kernel, a little later.
    print(f"slurm.ranks: task {environ.get('SLURM_PROCID', '?')} on {_node(environ)}: in MPI rank discovery "
          f"(a hang past {_MPI_TIMEOUT + _ALARM_MARGIN:.0f} s ends this task)", file=sys.stderr, flush=True)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(int(_MPI_TIMEOUT + _ALARM_MARGIN))
    try:
        return _mpi_rank(environ, phase)
    finally:
        signal.alarm(0)
        watchdog.cancel()


def _give_up(environ: Mapping[str, str], phase: list[str]) -> None:
    print(f"slurm.ranks: task {environ.get('SLURM_PROCID', '?')} on {_node(environ)}: still in {phase[0]} after "
          f"{_MPI_TIMEOUT:.0f} s of MPI rank discovery; exiting", file=sys.stderr, flush=True)
    os._exit(1)  # the main thread is stuck inside MPI: nothing else would end it


def _mpi_rank(environ: Mapping[str, str], phase: list[str]) -> TaskRank:
    from mpi4py import MPI  # MPI_Init here; only the tasks of a TP step pay for it

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    # The address other nodes reach this one by: its host name, as the worker's other advertised URLs.
    address = (socket.gethostname(), free_port_pair()) if rank == 0 else None
    phase[0] = "the broadcast of rank 0's address"
    master_addr, master_port = comm.bcast(address, root=0)
    phase[0] = "the allgather of the nodes"
    nodes = tuple(comm.allgather(_node(environ)))
    phase[0] = "MPI_Finalize"
    MPI.Finalize()
    return TaskRank(rank=rank, world_size=size, local_rank=nodes[:rank].count(nodes[rank]),
                    master_addr=master_addr, master_port=master_port, nodes=nodes, via="mpi")


def _from_slurm(run_dir: Path, environ: Mapping[str, str]) -> TaskRank:
    rank, size = int(environ.get("SLURM_PROCID", "0")), int(environ.get("SLURM_NTASKS", "1"))
    path = run_dir / RANKS_DIR / f"{environ.get('SLURM_JOB_ID', 'local')}.{environ.get('SLURM_STEP_ID', '0')}.addr"
    if rank == 0:
        master_addr, master_port = socket.gethostname(), free_port_pair()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(f"{master_addr} {master_port}\n")
        tmp.replace(path)  # readers on other nodes poll: never a half-written file
    else:
        master_addr, master_port = _wait_for_address(path)
    nodes = (_node(environ),) if size == 1 else ()
    return TaskRank(rank=rank, world_size=size, local_rank=int(environ.get("SLURM_LOCALID", "0")),
                    master_addr=master_addr, master_port=master_port, nodes=nodes, via="slurm")


def _wait_for_address(path: Path) -> tuple[str, int]:
    deadline = time.monotonic() + _ADDRESS_TIMEOUT
    while True:
        try:
            host, port = path.read_text().split()
            return host, int(port)
        except (FileNotFoundError, ValueError) as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not publish its address in {path} within "
                                   f"{_ADDRESS_TIMEOUT:.0f} s") from exc
            time.sleep(_POLL_SECONDS)


def write_rank_table(run_dir: Path, worker: str, rank: TaskRank) -> None:
    """Rank 0's record of where its worker's ranks run, for ``disagg status``."""
    path = run_dir / RANKS_DIR / f"{worker}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"world_size": rank.world_size, "nodes": list(rank.nodes), "via": rank.via,
              "master": f"{rank.master_addr}:{rank.master_port}"}
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def read_rank_table(run_dir: Path, worker: str) -> dict | None:
    try:
        return json.loads((run_dir / RANKS_DIR / f"{worker}.json").read_text())
    except (OSError, ValueError):
        return None
