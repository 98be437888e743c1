"""A tensor-parallel follower: engine rank 1..N-1 of a worker (``run_rank_follower``).

It connects to rank 0 (``rank_link.FollowerLink``), loads its shard (torch:
``ModelRunner`` with its ``TensorParallel``; synthetic: nothing), reports
ready, then runs every ``RankStep`` rank 0 sends: the forward on its shard,
meeting the other ranks in its all-reduces (rank 0 alone samples), or, for
the synthetic engine, an acknowledgement. It has no scheduler, no sockets to
frontends and no HTTP. It exits when rank 0 says ``RankStop``, when rank 0's
connection drops, when its launcher is gone, on SIGTERM, or when a collective
fails (a peer died): never waiting for a rank that is not there.

Locally the launcher runs ``python -m workers.rank_follower --spec FILE``
(FILE mode 0600, deleted once read, holds the key); under Slurm every task of
the worker's step runs ``disagg serve`` and the ranks > 0 land here.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

import msgspec
import zmq

from workers.config import EngineConfig
from workers.rank_env import RankEnv
from workers.rank_link import FollowerLink, RankLost
from workers.rank_protocol import RankFailed, RankHello, RankReady, RankStep, RankStepDone, RankStop

__all__ = ["FollowerSpec", "run_rank_follower", "main"]

log = logging.getLogger("disagg.rank")

POLL_MS = 500  # wake-up to check the launcher and SIGTERM while idle
START_TIMEOUT_SECONDS = 600.0  # rank 0 and the collective group must form within this


class FollowerSpec(msgspec.Struct, frozen=True):
    rank: RankEnv
    key_hex: str
    config: EngineConfig
    collective_timeout_seconds: float = 60.0  # factory.COLLECTIVE_TIMEOUT_SECONDS


def _rank_config(config: EngineConfig, local_rank: int) -> EngineConfig:
    """On CUDA each rank of a node takes the device of its local rank."""
    if config.kind == "torch" and config.device in ("auto", "cuda"):
        import torch

        if torch.cuda.is_available():
            return dataclasses.replace(config, device=f"cuda:{local_rank}")
    return config


def build_rank_runner(config: EngineConfig, rank: RankEnv, timeout: float) -> Any:
    """This rank's ``ModelRunner`` shard, its process group joined (rank 0 too)."""
    import torch

    from workers.engine.model.loader import resolve_device
    from workers.engine.model.parallel import init_process_group
    from workers.engine.model_runner import ModelRunner

    config = _rank_config(config, rank.local_rank)
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, rank.world_size)))
    tp = init_process_group(rank.rank, rank.world_size, rank.master_addr, rank.torch_store_port,
                            resolve_device(config.device), timeout)
    return ModelRunner(config, tp=tp)


class _Follower:
    def __init__(self, spec: FollowerSpec, link: FollowerLink, launcher_pid: int | None) -> None:
        self.spec, self.link, self.launcher_pid = spec, link, launcher_pid
        self.runner: Any = None
        self.should_stop = False

    def start(self) -> None:
        rank = self.spec.rank
        kv_heads = range(0)
        if self.spec.config.kind == "torch":
            self.runner = build_rank_runner(self.spec.config, rank, self.spec.collective_timeout_seconds)
            model_config = self.runner.model_config
            kv_heads = self.runner.tp.heads(model_config.num_heads, model_config.num_kv_heads).kv_heads
        self.link.send(RankReady(rank.rank, kv_heads.start, kv_heads.stop))
        log.info("tensor-parallel rank %d of %d ready (%s engine)", rank.rank, rank.world_size, self.spec.config.kind)

    def run(self) -> int:
        while not self.should_stop:
            if self.launcher_pid is not None and os.getppid() != self.launcher_pid:
                log.error("the launcher is gone: rank %d stops", self.spec.rank.rank)
                return 1
            message = self.link.recv(POLL_MS)
            if isinstance(message, RankStep):
                self._step(message)
            elif isinstance(message, RankStop):
                log.info("rank 0 stopped: rank %d exits", self.spec.rank.rank)
                return 0
        return 0

    def _step(self, step: RankStep) -> None:
        if self.runner is None:  # synthetic: the lockstep acknowledgement is all there is to do
            self.link.send(RankStepDone(self.spec.rank.rank, step.step))
            return
        self.runner.compute_logits(step)  # logits only on rank 0; ours join its gather


def run_rank_follower(spec: FollowerSpec, launcher_pid: int | None = None) -> int:
    rank = spec.rank
    ctx = zmq.Context()
    link = FollowerLink(ctx, bytes.fromhex(spec.key_hex), rank.rank, rank.master_addr, rank.master_port)
    link.send(RankHello(rank.rank, os.getpid()))
    follower = _Follower(spec, link, launcher_pid)
    signal.signal(signal.SIGTERM, lambda *_: setattr(follower, "should_stop", True))
    try:
        follower.start()
        return follower.run()
    except RankLost as exc:
        log.error("tensor-parallel rank %d stops: %s", rank.rank, exc)
        return 1
    except Exception as exc:  # a failed collective (a peer died), a bad shard, ...
        log.error("tensor-parallel rank %d failed: %s: %s", rank.rank, type(exc).__name__, exc)
        tail = "".join(traceback.format_exception(exc)[-3:]).strip()
        try:
            link.send(RankFailed(rank.rank, tail))
        except zmq.ZMQError:
            pass
        return 1
    finally:
        link.close()
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.rank_follower",
                                     description="a tensor-parallel engine rank > 0")
    parser.add_argument("--spec", required=True, help="FollowerSpec JSON file (mode 0600; deleted once read)")
    parser.add_argument("--launcher-pid", type=int, default=None, help="stop when this parent process is gone")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    spec_path = Path(args.spec)
    spec = msgspec.json.decode(spec_path.read_bytes(), type=FollowerSpec)
    spec_path.unlink()
    logging.basicConfig(level=args.log_level,
                        format=f"%(asctime)s rank{spec.rank.rank}[%(process)d] %(levelname)s %(message)s")
    return run_rank_follower(spec, args.launcher_pid)


if __name__ == "__main__":
    sys.exit(main())
