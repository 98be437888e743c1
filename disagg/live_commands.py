"""``disagg drain | undrain | scale | reload``: the commands that change a running deployment.

Each finds the deployment as ``status`` does and acts through ``disagg.live_change.Live``
(local) or ``disagg.slurm_live`` (Slurm: drain, undrain and scale). ``reload [CONFIG]``: the
supervisor re-reads the YAML and applies its live settings (``disagg.live_settings``).
Exit codes: 0 done, 1 not done (the message says what state it left), 2 a bad argument
or YAML, 3 (reload) some changed keys need a restart.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from disagg.live_change import Live, LiveChangeError
from disagg.run_state import SlurmRunState, find_state
from disagg.supervisor_control import Reload, SupervisorSilent, ask_supervisor

__all__ = ["add_live_commands", "run_live_command"]

DRAIN_TIMEOUT_SECONDS = 600.0
"""How long ``drain`` waits for a worker's requests in flight by default (the orchestrator's request timeout)."""


def add_live_commands(sub: Any, func: Callable[[argparse.Namespace], int]) -> None:
    for name, text in (("drain", "route no new requests to a worker; once its in-flight ones finish, stop it"),
                       ("undrain", "put a drained (still running) worker back in the rotation")):
        parser = sub.add_parser(name, help=text)
        parser.add_argument("worker", nargs="+", help="a worker's name as `disagg status` shows it (ctx-0) or its URL")
        _where(parser)
        if name == "drain":
            parser.add_argument("--keep", "--no-stop", action="store_true", dest="keep",
                                help="leave it running once drained (default: its supervisor stops it)")
            parser.add_argument("--timeout", type=float, default=DRAIN_TIMEOUT_SECONDS,
                                help="seconds to wait for its requests in flight (default %(default)g)")
            parser.add_argument("--force", action="store_true",
                                help="drain even the last worker of a phase in the rotation (its requests then fail)")
        parser.set_defaults(func=func, action=name)
    scale = sub.add_parser("scale", help="start or stop workers of a pool (ctx or gen) of a running deployment")
    scale.add_argument("pool", choices=("ctx", "gen"))
    scale.add_argument("instances", type=int, help="how many workers the pool should have (>= 1)")
    _where(scale)
    scale.add_argument("--timeout", type=float, default=DRAIN_TIMEOUT_SECONDS,
                       help="seconds to wait for new workers to be healthy, or removed ones to drain")
    scale.set_defaults(func=func, action="scale")
    reload = sub.add_parser("reload", help="re-read the deployment YAML and apply what can change live (exit 3: "
                                           "some changed keys need a restart)")
    reload.add_argument("config", nargs="?", default=None, help="the YAML (default: the one up read)")
    reload.add_argument("--run-dir", default=None)
    reload.set_defaults(func=func, action="reload")


def _where(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="the YAML used with up (for its run dir)")
    parser.add_argument("--run-dir", default=None)


def run_live_command(args: argparse.Namespace) -> int:
    from disagg.deployment import find_run_dir
    from orchestrator.typed import ConfigError

    try:
        run_dir = find_run_dir(args)
        state = None if run_dir is None else find_state(run_dir)
        if run_dir is None or state is None:
            raise LiveChangeError(f"no deployment running{'' if run_dir is None else f' from {run_dir}'}")
        if isinstance(state, SlurmRunState):
            from disagg.slurm_live import slurm_live

            live = slurm_live(run_dir, state, args.action)
        elif args.action == "reload":
            return _reload(run_dir, args.config)
        else:
            live = Live(run_dir, state.url, state.processes)
        if args.action == "drain":
            live.drain(args.worker, keep=args.keep, timeout=args.timeout, force=args.force)
        elif args.action == "undrain":
            live.undrain(args.worker)
        else:
            live.scale(args.pool, args.instances, args.timeout)
        return 0
    except ConfigError as exc:
        print(f"disagg {args.action}: {exc}", file=sys.stderr)
        return 2
    except (LiveChangeError, SupervisorSilent, httpx.HTTPError) as exc:
        print(f"disagg {args.action}: {exc}", file=sys.stderr)
        return 1


def _reload(run_dir: Path, config: str | None) -> int:
    """The supervisor re-reads the YAML (``disagg.live_settings``); 0 applied, 1 refused, 3 some keys need a restart."""
    answer = ask_supervisor(run_dir, Reload(config=None if config is None else str(Path(config).resolve())))
    print(answer.message, file=sys.stdout if answer.ok else sys.stderr)
    if not answer.ok:
        return 1
    return 3 if answer.needs_restart else 0
