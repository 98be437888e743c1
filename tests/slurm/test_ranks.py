"""slurm.ranks without MPI: Slurm's variables, rank 0's address through the run directory, and the
DISAGG_TP_* contract that workers.rank_env reads. (Under srun --mpi=pmix: test_emulated_cluster.py.)"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from slurm.ranks import discover_rank, free_port_pair, rank_environ

STEP = {"SLURM_JOB_ID": "41", "SLURM_STEP_ID": "3", "SLURM_NTASKS": "4", "SLURMD_NODENAME": "n7"}


def test_rank_0_publishes_its_address_and_the_others_find_it(tmp_path: Path) -> None:
    found = {}

    def follower() -> None:
        found["rank"] = discover_rank(tmp_path, {**STEP, "SLURM_PROCID": "3", "SLURM_LOCALID": "1"})

    thread = threading.Thread(target=follower)
    thread.start()  # polls before rank 0 has written anything
    leader = discover_rank(tmp_path, {**STEP, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"})
    thread.join(timeout=10)
    assert (leader.rank, leader.world_size, leader.local_rank, leader.via) == (0, 4, 0, "slurm")
    assert leader.master_addr == socket.gethostname()
    other = found["rank"]
    assert (other.rank, other.local_rank, other.master_addr, other.master_port) == \
        (3, 1, leader.master_addr, leader.master_port)
    assert (tmp_path / "ranks" / "41.3.addr").read_text() == f"{leader.master_addr} {leader.master_port}\n"


def test_the_port_pair_is_free() -> None:
    port = free_port_pair("127.0.0.1")
    for p in (port, port + 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_rank_environ_is_what_workers_rank_env_reads(tmp_path: Path) -> None:
    from workers import rank_env
    rank = discover_rank(tmp_path, {**STEP, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"})
    assert rank_env.from_environ(rank_environ(rank)) == rank_env.RankEnv(
        rank=0, world_size=4, local_rank=0, master_addr=rank.master_addr, master_port=rank.master_port)


def test_status_line_groups_consecutive_ranks_by_node(tmp_path: Path) -> None:
    from disagg.run_state import SlurmStep
    from disagg.slurm_deployment import _ranks_line
    from slurm.ranks import TaskRank, write_rank_table

    rank = TaskRank(rank=0, world_size=6, local_rank=0, master_addr="node-a", master_port=4000,
                    nodes=("n1", "n1", "n1", "n2", "n3", "n3"), via="mpi")
    write_rank_table(tmp_path, "gen-0", rank)
    step = SlurmStep(name="gen-0", port=8200, ranks=6)
    assert _ranks_line(tmp_path, step, ("7.2", "n[1-3]")) == \
        "6 ranks on n[1-3]: n1 0-2, n2 3, n3 4-5; rank 0 at node-a:4000"
    assert _ranks_line(tmp_path, step, None) == "6 ranks on -: n1 0-2, n2 3, n3 4-5; rank 0 at node-a:4000"
    assert _ranks_line(tmp_path, SlurmStep(name="ctx-0", port=8100), ("7.1", "n0")) == "1 rank on n0"
