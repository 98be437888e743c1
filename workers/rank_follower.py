"""A tensor-parallel follower: engine rank 1..N-1 of a worker (``run_rank_follower``).

It connects to rank 0 (``rank_link.FollowerLink``), loads its shard (torch:
``ModelRunner`` with its ``TensorParallel``; synthetic: nothing), reports
ready, then runs every ``RankStep`` rank 0 sends: the forward on its shard,
meeting the other ranks in its all-reduces (rank 0 alone samples), or, for
the synthetic engine, an acknowledgement. It has no scheduler, no sockets to
frontends and no HTTP. A runner that keeps state by block (DeepSeek-V4's)
drops it when rank 0 says the blocks are free (``RankFree``). In a disaggregated torch worker it also serves its own
KV heads of parked requests and pulls its own heads for rank 0's gen
requests (``kv_rank_pulls``), between steps. It exits when rank 0 says ``RankStop``, when rank 0's
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
import time
import traceback
from pathlib import Path
from typing import Any

import msgspec
import zmq

from common.log_format import LOG_FORMATS, configure_logging
from workers.config import EngineConfig
from workers.kv_transfer import DisaggEngineSpec
from workers.rank_env import RankEnv
from workers.rank_link import FollowerLink, RankLost
from workers.rank_protocol import (
    RankAbortPull,
    RankFailed,
    RankFree,
    RankHello,
    RankPark,
    RankPull,
    RankPullDone,
    RankReady,
    RankStep,
    RankStepDone,
    RankStop,
    RankUnpark,
    RankWelcome,
)

__all__ = ["FollowerSpec", "run_rank_follower", "main"]

log = logging.getLogger("disagg.rank")

POLL_MS = 500  # wake-up to check the launcher and SIGTERM while idle
START_TIMEOUT_SECONDS = 600.0  # rank 0 and the collective group must form within this


class FollowerSpec(msgspec.Struct, frozen=True):
    rank: RankEnv
    key_hex: str
    config: EngineConfig
    collective_timeout_seconds: float = 60.0  # factory.COLLECTIVE_TIMEOUT_SECONDS
    disagg: DisaggEngineSpec | None = None  # the worker's KV transfer (cluster key, KV host): torch ranks serve it


def _rank_config(config: EngineConfig, local_rank: int) -> EngineConfig:
    """On CUDA each rank of a node takes the device of its local rank among those it sees: all of
    the worker's GPUs on the node (a step of ``--gres=gpu:N``), or, bound by Slurm's ``--gpu-bind``
    (a worker sharing its node, ``slurm.plan``), its own one."""
    if config.kind == "torch" and config.device in ("auto", "cuda"):
        import torch

        if torch.cuda.is_available():
            return dataclasses.replace(config, device=f"cuda:{local_rank % torch.cuda.device_count()}")
    return config


def build_rank_runner(config: EngineConfig, rank: RankEnv, timeout: float, store: Any) -> Any:
    """This rank's shard (a ``ModelRunner``, or a ``DeepseekV4Runner`` for such a checkpoint), its
    process group joined at ``store`` (rank 0 too)."""
    import torch

    from workers.engine.model.deepseek_v4.config import is_deepseek_v4_dir
    from workers.engine.model.loader import resolve_device
    from workers.engine.model.parallel import init_process_group
    from workers.engine.model_runner import ModelRunner

    config = _rank_config(config, rank.local_rank)
    device = resolve_device(config.device)
    if device.type == "cpu":  # the ranks share the cores: N ranks of all threads each would oversubscribe them
        torch.set_num_threads(max(1, torch.get_num_threads() // rank.world_size))
    tp = init_process_group(rank.rank, rank.world_size, store, device, timeout)
    if is_deepseek_v4_dir(config.model):
        from workers.engine.model.deepseek_v4.runner import DeepseekV4Runner

        return DeepseekV4Runner(config, tp=tp)
    return ModelRunner(config, tp=tp)


class _Follower:
    def __init__(self, spec: FollowerSpec, link: FollowerLink, launcher_pid: int | None, ctx: zmq.Context) -> None:
        self.spec, self.link, self.launcher_pid, self.ctx = spec, link, launcher_pid, ctx
        self.runner: Any = None
        self.kv_store: Any = None  # FollowerKVStore, KVTransferAgent, KVHeadPuller of a disaggregated torch rank
        self.kv_agent: Any = None
        self.puller: Any = None
        self.should_stop = False
        self._poller = zmq.Poller()
        self._poller.register(link.sock, zmq.POLLIN)
        self._poller.register(link.monitor, zmq.POLLIN)

    def start(self) -> None:
        rank = self.spec.rank
        kv_heads = range(0)
        if self.spec.config.kind == "torch":
            from workers.engine.model.parallel import tcp_store

            store = tcp_store(rank.master_addr, self._welcome().store_port, rank.world_size, False,
                              START_TIMEOUT_SECONDS)
            self.runner = build_rank_runner(self.spec.config, rank, self.spec.collective_timeout_seconds, store)
            model_config = self.runner.model_config
            kv_heads = self.runner.tp.heads(model_config.num_heads, model_config.num_kv_heads).kv_heads
        kv_endpoint = self._start_kv(self.spec.disagg) if self.runner is not None and self.spec.disagg is not None else None
        self.link.send(RankReady(rank.rank, kv_heads.start, kv_heads.stop, kv_endpoint))
        log.info("tensor-parallel rank %d of %d ready (%s engine)", rank.rank, rank.world_size, self.spec.config.kind)

    def _welcome(self) -> RankWelcome:
        """Rank 0's ``RankWelcome`` (every rank connected); RankLost if it never comes."""
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            message = self.link.recv(POLL_MS)
            if isinstance(message, RankWelcome):
                return message
            if isinstance(message, RankStop) or self.should_stop:
                raise RankLost("rank 0 stopped before the group formed")
        raise RankLost(f"rank 0 did not form the group within {START_TIMEOUT_SECONDS:g} s")

    def _start_kv(self, disagg: DisaggEngineSpec) -> str:
        from workers.kv_rank_pulls import FollowerKVStore, KVHeadPuller
        from workers.kv_transfer import KVTransferAgent

        key = bytes.fromhex(disagg.cluster_key_hex)
        store = FollowerKVStore(self.runner)  # typed here: mypy checks it against ``kv_core.KVCore``
        self.kv_store = store
        self.kv_agent = KVTransferAgent(store, key, self.ctx, disagg.kv_host, 0, disagg.kv_advertise_host,
                                        disagg.pull_timeout_seconds)
        self.kv_agent.register(self._poller)
        self.puller = KVHeadPuller(self.ctx, key, self.runner.import_heads, disagg.pull_timeout_seconds)
        self.puller.register(self._poller)
        return self.kv_agent.endpoint

    def run(self) -> int:
        while not self.should_stop:
            if self.launcher_pid is not None and os.getppid() != self.launcher_pid:
                log.error("the launcher is gone: rank %d stops", self.spec.rank.rank)
                return 1
            busy = self.kv_agent is not None and self.kv_agent.has_work()
            self._poller.poll(0 if busy else POLL_MS)
            while (message := self.link.recv(0)) is not None:  # in order: an abort before the step after it
                if isinstance(message, RankStop):
                    log.info("rank 0 stopped: rank %d exits", self.spec.rank.rank)
                    return 0
                self._handle(message)
            if self.kv_agent is not None:
                self.kv_agent.tick()
                for pull_id, error, num_bytes in self.puller.tick():
                    self.link.send(RankPullDone(self.spec.rank.rank, pull_id, error, num_bytes))
        return 0

    def _handle(self, message: Any) -> None:
        if isinstance(message, RankStep):
            self._step(message)
        elif isinstance(message, RankPark):
            self.kv_store.park(message)
        elif isinstance(message, RankUnpark):
            self.kv_store.release_parked(message.ctx_request_id)
        elif isinstance(message, RankPull):
            from workers.kv_layout import PullSource

            sources = [PullSource(p.endpoint, range(p.ctx_start, p.ctx_stop), range(p.local_start, p.local_stop))
                       for p in message.pieces]
            self.puller.start(message.pull_id, message.ctx_request_id, message.first_block, message.block_ids,
                              sources)
        elif isinstance(message, RankAbortPull):
            self.puller.abort(message.pull_id)
        elif isinstance(message, RankFree):
            self.runner.blocks_freed(message.block_ids)

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
    follower = _Follower(spec, link, launcher_pid, ctx)
    signal.signal(signal.SIGTERM, lambda *_: setattr(follower, "should_stop", True))
    try:
        follower.start()
        return follower.run()
    except RankLost as exc:
        log.error("tensor-parallel rank %d stops: %s", rank.rank, exc)
        return 1
    except Exception as exc:  # noqa: BLE001 - a failed collective (a peer died), a bad shard, ...
        log.error("tensor-parallel rank %d failed: %s: %s", rank.rank, type(exc).__name__, exc)
        tail = "".join(traceback.format_exception(exc)[-3:]).strip()
        try:
            link.send(RankFailed(rank.rank, tail))
        except zmq.ZMQError:
            pass
        return 1
    finally:
        if follower.kv_agent is not None:
            follower.kv_agent.close()
            follower.puller.close()
        link.close()
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.rank_follower",
                                     description="a tensor-parallel engine rank > 0")
    parser.add_argument("--spec", required=True, help="FollowerSpec JSON file (mode 0600; deleted once read)")
    parser.add_argument("--launcher-pid", type=int, default=None, help="stop when this parent process is gone")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text")
    args = parser.parse_args(argv)
    spec_path = Path(args.spec)
    spec = msgspec.json.decode(spec_path.read_bytes(), type=FollowerSpec)
    spec_path.unlink()
    role = f"rank{spec.rank.rank}"
    configure_logging(args.log_level, args.log_format, role, f"%(asctime)s {role}[%(process)d] %(levelname)s %(message)s")
    return run_rank_follower(spec, args.launcher_pid)


if __name__ == "__main__":
    sys.exit(main())
