"""``disagg up | status | down | logs``: a local deployment as supervised subprocesses.

``up CONFIG`` validates the YAML (``disagg.deploy_config``), then starts a
*supervisor* (``up CONFIG --foreground``, detached, its own output in
``<run dir>/up.log``) and waits, with a progress line, until the
orchestrator's /health answers 200; it prints the URL and returns. With
``--foreground`` the supervisor is the command itself. The supervisor:

1. resolves the model (``tiny`` or a missing dir -> ``make_tiny_model``) and
   builds the ``disagg.deploy_plan.local_plan`` (every process's argv),
2. writes the cluster key file (0600) and the plan's ``orchestrator.json``,
3. starts every worker (``disagg serve --role ctx|gen ...``) and the
   orchestrator, each in its own session, logs in ``<run dir>/logs/<name>.log``,
4. records them in ``<run dir>/state.json`` (a ``disagg.run_state.LocalRunState``:
   what status/down/logs read), each as pid and start time (``disagg.run_dir_guard``),
5. restarts a process that exits unexpectedly (for the orchestrator: its
   keeper, which adopts the serving processes still running and respawns
   those that die itself), within the YAML's ``restarts``
   budget over a sliding window; a process past it is left down and marked in
   the state (``disagg status`` says so) while the others keep serving,
6. on SIGTERM/SIGINT stops the orchestrator first (it stops accepting and lets
   in-flight requests finish within its ``grace_seconds``, as long as the
   workers'), then the workers together (SIGTERM, then SIGKILL after
   ``STOP_SECONDS``) and removes the runtime files (state,
   key, orchestrator state dir). Logs stay. The orchestrator's own processes
   are recorded in its state dir (``orchestrator.process_records``): ``down``
   stops any of them still running, also one that outlived its parent.

The supervisor is ``disagg.supervisor``; while it runs, ``disagg drain``,
``scale`` and ``reload`` change what it runs (``disagg.live_commands``).

``up`` refuses while the run dir has a live owner (its supervisor, or, when
that was killed, any recorded process: an orphan) or a port the config fixes
is taken. ``down`` signals the supervisor and waits for it; if the supervisor
is gone, it stops the recorded processes itself; either way only a pid whose
start time still matches is signalled, and with nothing running it says so
and exits 0. Both sweep ``/tmp/disagg-*`` IPC dirs whose workers are gone.

``up`` also writes ``<run dir>/prometheus.yml``, whose scrape targets the
orchestrator keeps current (``orchestrator.prometheus_sd``). What
``status`` prints (text or ``--json``) is ``disagg.deploy_status``, ``logs``
(also after ``down``, and ``-f``) is ``disagg.deploy_logs``, and ``up``'s
progress line (live on a terminal, one line per change otherwise) is
``disagg.progress``.

With ``launcher: slurm`` in the file (or ``up --launcher slurm``) the deployment
is one Slurm job instead: ``disagg.slurm_deployment`` (its run dir holds
``slurm.json`` rather than ``state.json``; status and down dispatch on that).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disagg.deploy_logs import tail
from disagg.deploy_plan import ORCHESTRATOR_STATE_DIR, api_headers
from disagg.progress import ProgressLine
from disagg.run_dir_guard import busy_ports, live_processes, recorded_processes, stop_recorded
from disagg.run_dir_link import down_command, link_run_dir
from disagg.run_state import (
    STATE_FILES,
    STOP_SECONDS,
    LocalRunState,
    SlurmRunState,
    clean,
    find_state,
    orchestrator_stop_seconds,
    read_state,
)
from orchestrator.process_records import sweep
from orchestrator.readiness import health_progress
from workers.ipc_dir_owners import sweep_stale_ipc_dirs

if TYPE_CHECKING:  # the CLI imports this module to add its subcommands: keep that import light
    from disagg.deploy_config import DeployConfig

__all__ = ["add_deployment_commands", "run_deployment_command", "default_run_dir", "find_run_dir", "STOP_SECONDS",
           "orchestrator_stop_seconds"]

RUNS_ROOT = Path(".disagg")
"""Where run dirs are by default (``.disagg/<config name>``) and where status/down/logs look."""


def default_run_dir(config_path: str) -> str:
    return str(RUNS_ROOT / Path(config_path).stem)


def add_deployment_commands(sub: Any, func: Callable[[argparse.Namespace], int]) -> None:
    up = sub.add_parser("up", help="start a deployment from a YAML file (local processes or a Slurm job)")
    up.add_argument("config")
    up.add_argument("--run-dir", default=None, help="default: the file's run_dir, else ./.disagg/<name>")
    up.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops everything")
    up.add_argument("--launcher", choices=("local", "slurm"), default=None, help="default: the file's launcher")
    up.set_defaults(func=func, action="up")
    for name, text in (("status", "show a deployment's processes and workers (exit 1: not running or not answering)"),
                       ("down", "stop a deployment and remove its runtime files (exit 0 when nothing runs)")):
        parser = sub.add_parser(name, help=text)
        parser.add_argument("config", nargs="?", default=None, help="the YAML used with up (for its run dir)")
        parser.add_argument("--run-dir", default=None)
        parser.set_defaults(func=func, action=name)
        if name == "status":
            parser.add_argument("--json", action="store_true", help="one JSON object (disagg.deploy_status)")
    logs = sub.add_parser("logs", help="print a deployment's logs (kept after down; default: the last run's)")
    logs.add_argument("name", nargs="?", default=None,
                      help="a process name (see status) or supervisor; default: all, tails")
    logs.add_argument("--config", default=None)
    logs.add_argument("--run-dir", default=None)
    logs.add_argument("--lines", "-n", type=int, default=40, help="lines per log when showing all or following")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing what is appended (Ctrl-C stops)")
    logs.set_defaults(func=func, action="logs")


def run_deployment_command(args: argparse.Namespace) -> int:
    from disagg.deploy_config import TINY_MODEL, check_deploy_model, load_deploy_config, resolve_deploy_model
    from disagg.model_names import ModelNotFoundError
    from orchestrator.typed import ConfigError

    try:
        if args.action == "up":
            config = load_deploy_config(args.config, args.run_dir)
            # Bare status/down/logs look under ./.disagg: a run dir elsewhere is linked from there.
            stop = down_command(link_run_dir(RUNS_ROOT, config.name, config.run_path), config.run_path)
            if (args.launcher or config.launcher) == "slurm":
                from disagg.slurm_deployment import slurm_up

                if config.model != TINY_MODEL:  # before a job waits in the queue (the file system is shared)
                    check_deploy_model(config)
                return slurm_up(config, args.config, config.run_path, stop)
            resolve_deploy_model(config, config.run_path)  # here, so a missing model is one line, not a log
            refusal = _refusal(config)
            if refusal:
                print(f"disagg up: {refusal}", file=sys.stderr)
                return 1
            if args.foreground:
                from disagg.supervisor import supervise

                return supervise(config)
            return _up_detached(config, args, stop)
        run_dir = find_run_dir(args)
        if run_dir is None:
            return _nothing_found(args)
        if args.action == "logs":  # the same files under either launcher
            from disagg.deploy_logs import print_logs

            return print_logs(run_dir, args.name, args.lines, args.follow)
        state = find_state(run_dir)
        if isinstance(state, SlurmRunState):
            from disagg.slurm_deployment import slurm_down, slurm_status

            return slurm_status(run_dir, state, args.json) if args.action == "status" else slurm_down(run_dir, state)
        if args.action == "status":
            from disagg.deploy_status import local_status, print_status

            return print_status(local_status(run_dir, state), args.json)
        return _down(run_dir, state)
    except (ConfigError, ModelNotFoundError) as exc:
        print(f"disagg {args.action}: {exc}", file=sys.stderr)
        return 2


def find_run_dir(args: argparse.Namespace) -> Path | None:
    """The run dir named (--run-dir, CONFIG), else the one deployment running under ./.disagg; for
    ``logs`` with none running, the last run's (its logs outlive it). None: nothing to act on."""
    from disagg.deploy_config import load_deploy_config
    from orchestrator.typed import ConfigError

    if args.run_dir:
        return Path(args.run_dir)
    config = getattr(args, "config", None)
    if config:
        return load_deploy_config(config).run_path
    # A link (``disagg.run_dir_link``) leads to a run dir elsewhere: named by where it really is.
    runs = sorted({_real(p.parent) for name in STATE_FILES for p in RUNS_ROOT.glob(f"*/{name}")})
    if len(runs) > 1:
        raise ConfigError("run_dir", f"{len(runs)} deployments run under ./{RUNS_ROOT} "
                                     f"({', '.join(r.name for r in runs)}): name one (CONFIG or --run-dir)")
    if runs:
        return runs[0]
    if args.action == "logs":
        logged = [d for d in RUNS_ROOT.glob("*") if (d / "up.log").is_file()]
        if logged:
            last = _real(max(logged, key=lambda d: (d / "up.log").stat().st_mtime))
            print(f"disagg logs: nothing runs; the last run's logs, {last}", file=sys.stderr)
            return last
    return None


def _real(run_dir: Path) -> Path:
    return run_dir.resolve() if run_dir.is_symlink() else run_dir


def _nothing_found(args: argparse.Namespace) -> int:
    """No run dir named and none running under ./.disagg: one line (and for down: nothing to do, exit 0)."""
    where = f"no deployment running under ./{RUNS_ROOT}"
    if args.action == "status":
        from disagg.deploy_status import not_running, print_status

        return print_status(not_running(None, where), args.json)
    if args.action == "down":
        print(f"disagg down: {where}; nothing to stop")
        _sweep_ipc_dirs()
        return 0
    print(f"disagg logs: no deployment logs under ./{RUNS_ROOT} (name one with CONFIG or --run-dir)",
          file=sys.stderr)
    return 1


# -- up -----------------------------------------------------------------------------------------

def _refusal(config: DeployConfig) -> str | None:
    """Why ``up`` must not start here (a live or orphaned deployment owns the run dir, or a port the
    config fixes is taken), or None. Starting anyway would bind beside the old one and, at its own
    exit, delete the old one's state and key."""
    run_dir = config.run_path
    state = read_state(run_dir, LocalRunState)
    if state is not None:
        live = live_processes(state)
        if live:
            names = ", ".join(f"{p.name} (pid {p.pid})" for p in live)
            orphan = "" if live[0].name == "supervisor" else "; its supervisor is gone: an orphan"
            return (f"a deployment already runs from {run_dir} ({state.url}): {names}{orphan}; "
                    f"`disagg down` first")
        clean(run_dir, LocalRunState)  # a dead deployment's leftovers: nothing owns them any more
    busy = busy_ports(config)
    if busy:
        return f"port{'s' if len(busy) > 1 else ''} already in use: {', '.join(busy)}; is another deployment up?"
    return None


def _up_detached(config: DeployConfig, args: argparse.Namespace, stop: str) -> int:
    """``stop``: the ``down`` command that finds this deployment (``disagg.run_dir_link``)."""
    run_dir = config.run_path
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "disagg.cli", "up", str(args.config), "--run-dir", str(run_dir), "--foreground"]
    with open(run_dir / "up.log", "w") as log:
        supervisor = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
    deadline = time.monotonic() + config.startup_timeout_seconds
    ready_processes: set[int] = set()
    progress = ProgressLine()
    progress.update(f"disagg up: starting the supervisor (its log: {run_dir / 'up.log'})")
    while time.monotonic() < deadline:
        if supervisor.poll() is not None:
            progress.finish()
            print(f"disagg up: failed (exit code {supervisor.returncode}); {run_dir / 'up.log'}:", file=sys.stderr)
            print(tail(run_dir / "up.log", 30), file=sys.stderr)
            return 1
        state = read_state(run_dir, LocalRunState)
        if state is not None:
            line = health_progress(state.url, ready_processes, api_headers(run_dir))
            progress.update(f"disagg up: starting {len(state.processes)} processes ... {line}")
            if line == "ready":
                progress.finish()
                print(f"disagg up: ready on {state.url} (run dir {run_dir}; `{stop}` stops it)", flush=True)
                return 0
        time.sleep(0.5)
    progress.finish()
    print(f"disagg up: not healthy after {config.startup_timeout_seconds} s; stopping", file=sys.stderr)
    _down(run_dir, read_state(run_dir, LocalRunState))
    return 1


# -- status / down / logs ---------------------------------------------------------------------

def _down(run_dir: Path, state: LocalRunState | None) -> int:
    """Stop what the run dir records (``state``), signalling only pids whose start time still matches
    (a recycled pid is never signalled); with nothing running, one line and exit 0."""
    if state is None:
        print(f"disagg down: nothing running from {run_dir}")
        _sweep_ipc_dirs()
        return 0
    supervisor, *children = recorded_processes(state)
    supervised = supervisor.pid != os.getpid() and supervisor.running()
    orchestrator_seconds = state.orchestrator_stop_seconds
    if supervised:
        # The supervisor stops its children itself (orchestrator first) and cleans up.
        stop_recorded([supervisor], orchestrator_seconds + STOP_SECONDS + 10)
    # Whatever is left: a supervisor that died (or was just killed) leaves these behind. The orchestrator
    # goes first, so no request is routed to a stopping worker: its keeper and serving processes as
    # recorded in its state dir (one that outlived its keeper too), then the rest, its keeper (last
    # in the list) first.
    swept = sweep(run_dir / ORCHESTRATOR_STATE_DIR, orchestrator_seconds)
    stopped = stop_recorded(list(reversed(children)), orchestrator_seconds)
    legacy = [p for p in children if p.start_time is None and p.may_be_running()]
    clean(run_dir, LocalRunState)
    _sweep_ipc_dirs()
    if swept:
        print(f"disagg down: stopped {len(swept)} orchestrator processes left running "
              f"(pids {', '.join(map(str, swept))})")
    if not supervised and not stopped and not swept and not legacy:
        print(f"disagg down: nothing was running from {run_dir}; removed its stale runtime files")
        return 0
    orphan = "" if supervised else " (unsupervised: its supervisor was gone)"
    print(f"disagg down: stopped {len(state.processes)} processes from {run_dir}{orphan}")
    for process in legacy:
        print(f"disagg down: pid {process.pid} ({process.name}) was recorded without a start time and runs: "
              f"not signalled, it may be a different process", file=sys.stderr)
    return 0


def _sweep_ipc_dirs() -> None:
    for path in sweep_stale_ipc_dirs():
        print(f"disagg down: removed {path} (its worker's processes are gone)")
