"""Builds the executor an ``EngineConfig`` asks for.

The torch executor is imported lazily so the synthetic engine never imports torch.
"""

from __future__ import annotations

from typing import Any

from workers.config import ConfigError, EngineConfig
from workers.engine.executor import Executor
from workers.engine.model.deepseek_v4.config import is_deepseek_v4_dir

__all__ = ["build_executor", "build_leader_executor", "COLLECTIVE_TIMEOUT_SECONDS"]

# A collective waits this long for a rank that hangs (one that dies fails it at once).
COLLECTIVE_TIMEOUT_SECONDS = 60.0


def build_executor(config: EngineConfig) -> Executor:
    if config.kind == "synthetic":
        from workers.engine.synthetic import SyntheticExecutor

        return SyntheticExecutor(config)
    if config.kind == "torch":
        if is_deepseek_v4_dir(config.model):
            from workers.engine.model.deepseek_v4.runner import DeepseekV4Runner

            return DeepseekV4Runner(config)
        from workers.engine.model_runner import ModelRunner

        return ModelRunner(config)
    raise ConfigError("engine.kind", f"must be 'torch' or 'synthetic', got {config.kind!r}")


def build_leader_executor(config: EngineConfig, link: Any, ranks: Any, start_timeout: float) -> Executor:
    """Rank 0's executor of a tensor-parallel group (``LeaderExecutor``), once every follower is ready.

    ``link`` is rank 0's bound ``LeaderLink``. The torch engine hosts the group's store on a
    port of its own choosing, sends it to the followers once all said hello (``RankWelcome``),
    joins the process group and loads its shard.
    """
    from workers.engine.leader_executor import LeaderExecutor

    if config.kind == "synthetic":
        inner = build_executor(config)
    else:
        from workers.engine.model.parallel import tcp_store
        from workers.rank_follower import build_rank_runner
        from workers.rank_protocol import RankWelcome

        store = tcp_store(ranks.master_addr, 0, ranks.world_size, True, start_timeout)
        link.wait_hellos(start_timeout)
        link.send_all(RankWelcome(store.port))
        inner = build_rank_runner(config, ranks, COLLECTIVE_TIMEOUT_SECONDS, store)
    link.wait_ready(start_timeout)
    return LeaderExecutor(inner, link, wait_for_acks=config.kind == "synthetic")

