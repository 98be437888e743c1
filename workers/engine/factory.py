"""Builds the executor an ``EngineConfig`` asks for.

The torch executor is imported lazily so the synthetic engine never imports torch.
"""

from __future__ import annotations

from workers.config import ConfigError, EngineConfig
from workers.engine.executor import Executor

__all__ = ["build_executor"]


def build_executor(config: EngineConfig) -> Executor:
    if config.kind == "synthetic":
        from workers.engine.synthetic import SyntheticExecutor

        return SyntheticExecutor(config)
    if config.kind == "torch":
        from workers.engine.model_runner import ModelRunner

        return ModelRunner(config)
    raise ConfigError("engine.kind", f"must be 'torch' or 'synthetic', got {config.kind!r}")
