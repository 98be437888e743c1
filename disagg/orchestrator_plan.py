"""``python -m disagg.orchestrator_plan CONFIG --run-dir DIR``: the Slurm job's setup step.

The batch shell runs it once, before any step starts: it resolves the model
(``tiny`` -> a random-weight one written to DIR/model) and writes
DIR/orchestrator.json from the same ``disagg.deploy_plan.slurm_plan`` that
``disagg up`` rendered the job from, now with the job's real run directory.
The local launcher writes the same file from its ``local_plan``, so a key
added to the ``orchestrator:`` section reaches the orchestrator the same way
under either launcher. Torch-free (it runs on a CPU node before any engine).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from disagg.deploy_config import load_deploy_config, resolve_deploy_model
    from disagg.deploy_plan import slurm_plan
    from disagg.model_names import ModelNotFoundError

    parser = argparse.ArgumentParser(prog="python -m disagg.orchestrator_plan")
    parser.add_argument("config")
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    config = load_deploy_config(args.config)
    run_dir = Path(args.run_dir).resolve()
    try:
        model = resolve_deploy_model(config, run_dir)  # writes the tiny model on first use
    except ModelNotFoundError as exc:  # one line in the job's log, not a traceback
        print(f"disagg setup: {exc}", file=sys.stderr)
        return 2
    slurm_plan(config, args.config, run_dir=str(run_dir), model=str(model)).write_orchestrator_config()
    return 0


if __name__ == "__main__":
    sys.exit(main())
