"""The one place a deployment config becomes the orchestrator's config.

``disagg up`` (local: static workers known up front) and the Slurm job's setup step
(``python -m disagg.orchestrator_plan CONFIG --run-dir DIR``: no static workers, every
worker registers itself) both call :func:`orchestrator_config`, so a key added to the
``orchestrator:`` section reaches the orchestrator the same way under either launcher.
Torch-free (the Slurm setup step runs it on a CPU node before any engine starts).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.config import OrchestratorConfig, StaticWorker
from orchestrator.prometheus_sd import TARGETS_DIR

if TYPE_CHECKING:
    from disagg.deploy_config import DeployConfig

__all__ = ["ORCHESTRATOR_CONFIG_FILE", "orchestrator_config", "write_orchestrator_config", "main"]

ORCHESTRATOR_CONFIG_FILE = "orchestrator.json"


def orchestrator_config(config: DeployConfig, *, model: Path, state_dir: Path, host: str, port: int,
                        workers: tuple[StaticWorker, ...] = (), targets_dir: Path | None = None) -> OrchestratorConfig:
    """``config``'s orchestrator section, serving ``model`` from ``host:port``; ``targets_dir``: where
    it keeps the Prometheus target files (``<run dir>/prometheus/targets``, ``orchestrator.prometheus_sd``)."""
    s = config.orchestrator
    return OrchestratorConfig(
        model_dir=str(model), state_dir=str(state_dir), served_model_name=config.served_model_name,
        host=host, port=port, processes=s.processes, ctx_router=s.ctx_router, gen_router=s.gen_router,
        conditional=s.conditional, health=s.health, timeouts=s.timeouts, max_retries=s.max_retries,
        api_key=s.api_key, workers=workers, default_block_size=config.engine.block_size or 16,
        max_request_bytes=s.max_request_bytes, prometheus_targets_dir=None if targets_dir is None else str(targets_dir))


def write_orchestrator_config(run_dir: Path, orch: OrchestratorConfig) -> Path:
    path = run_dir / ORCHESTRATOR_CONFIG_FILE
    path.write_text(orch.to_json())
    return path


def main(argv: list[str] | None = None) -> int:
    """The Slurm job's setup step: the model (``tiny`` -> a random-weight one in DIR/model) and
    DIR/orchestrator.json, once, in the batch shell before any step starts."""
    from disagg.deploy_config import load_deploy_config, resolve_deploy_model

    parser = argparse.ArgumentParser(prog="python -m disagg.orchestrator_plan")
    parser.add_argument("config")
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    config = load_deploy_config(args.config)
    run_dir = Path(args.run_dir).resolve()
    model = resolve_deploy_model(config, run_dir)  # writes the tiny model on first use
    write_orchestrator_config(run_dir, orchestrator_config(
        config, model=model, state_dir=run_dir / "orchestrator", host="0.0.0.0", port=config.orchestrator.port,
        targets_dir=run_dir / TARGETS_DIR))
    return 0


if __name__ == "__main__":
    sys.exit(main())
