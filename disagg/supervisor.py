"""The local supervisor (``disagg up --foreground``): starts every process, restarts it, changes the set.

Each round (``ROUND_SECONDS``) it restarts a process that exited within its
restart budget (``disagg.deployment`` describes the policy), then acts on the
requests of the control channel (``disagg.supervisor_control``):

- ``RetireWorkers``: SIGTERM to the named workers (each finishes what it
  holds within its grace period; ``disagg drain`` has already taken it out
  of the rotation), never restarted; they leave the orchestrator's static
  list in ``orchestrator.json``, so an orchestrator restart does not bring
  them back.
- ``AddWorkers``: new workers of a pool, named ``<pool>-<i>`` with the lowest
  free ``i`` (a retired worker's name is reused, its log appended to),
  started with ``--register-url`` (the orchestrator's URL and, with an API
  key, ``api.key``): they join by registration and heartbeats, and
  deregister when they stop.
- ``Reload``: the YAML re-read and its live settings applied
  (``disagg.live_settings``); SIGHUP asks the same.

Workers stay before the orchestrator in the state's process list, which
stays last: the supervisor and ``down`` stop it first.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from common.process_identity import process_start_time
from common.processes import stop_process, stop_processes
from common.restart_budget import RestartBudget
from disagg.deploy_plan import API_KEY_FILE, KEY_FILE, WORKER_KEY_FILE, write_scrape_config, write_secret
from disagg.run_state import STOP_SECONDS, LocalRunState, ProcessRecord, clean, orchestrator_stop_seconds, write_state
from disagg.supervisor_control import (
    AddWorkers,
    ControlAnswer,
    ControlRequest,
    Reload,
    RetireWorkers,
    answer_request,
    take_requests,
)
from orchestrator.process_records import sweep

if TYPE_CHECKING:
    from disagg.deploy_config import DeployConfig
    from disagg.deploy_plan import DeployPlan

__all__ = ["supervise", "ROUND_SECONDS"]

ROUND_SECONDS = 0.2


def supervise(config: DeployConfig) -> int:
    """Run the deployment until SIGTERM/SIGINT (or every process left down); its exit code."""
    run_dir = config.run_path
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    signals: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: signals.append(signum))
    supervisor = _Supervisor(config, run_dir, _prepare(config, run_dir))
    try:
        return supervisor.run(signals)
    finally:
        supervisor.stop_all()
        clean(run_dir, LocalRunState)


def _prepare(config: DeployConfig, run_dir: Path) -> DeployPlan:
    """The plan to run; writes the key (0600), the orchestrator's config and Prometheus's."""
    from disagg.core_partition import available_cores, engine_threads
    from disagg.deploy_config import resolve_deploy_model
    from disagg.deploy_plan import local_plan

    model = resolve_deploy_model(config, run_dir)
    for name in (KEY_FILE, WORKER_KEY_FILE):  # fresh for each `up`: a restart rotates both
        write_secret(run_dir / name, secrets.token_hex(32))
    plan = local_plan(config, run_dir, model, engine_threads(config, available_cores()))
    plan.write_orchestrator_config()
    write_scrape_config(config, run_dir)
    return plan


def _start(run_dir: Path, process: ProcessRecord) -> subprocess.Popen:
    log_path = run_dir / "logs" / f"{process.name}.log"
    with open(log_path, "a") as log:
        child = subprocess.Popen(process.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
    process.pid, process.start_time, process.log = child.pid, process_start_time(child.pid), str(log_path)
    return child


def _index(name: str) -> int:
    """``ctx-3`` -> 3."""
    return int(name.rsplit("-", 1)[1])


class _Supervisor:
    def __init__(self, config: DeployConfig, run_dir: Path, plan: DeployPlan) -> None:
        self.config, self.run_dir, self.plan = config, run_dir, plan
        self.processes = [ProcessRecord(name=p.name, url=p.url, argv=list(p.argv), pool=getattr(p, "pool", None))
                          for p in plan.processes]
        self.children: dict[str, subprocess.Popen] = {}
        self.state = LocalRunState(config=config.source, url=plan.orchestrator.url, supervisor_pid=os.getpid(),
                                   supervisor_start_time=process_start_time(os.getpid()), processes=self.processes,
                                   started_at=time.time(),
                                   orchestrator_stop_seconds=orchestrator_stop_seconds(config.orchestrator.grace_seconds))
        policy = config.restarts
        self.budgets = {p.name: RestartBudget(policy.max_restarts, policy.window_seconds) for p in self.processes}

    def run(self, signals: list[int]) -> int:
        for process in self.processes:
            self.children[process.name] = _start(self.run_dir, process)
        write_state(self.run_dir, self.state)
        print(f"disagg up: supervising {len(self.processes)} processes; orchestrator on {self.state.url}", flush=True)
        while True:
            time.sleep(ROUND_SECONDS)
            while signals and signals[0] == signal.SIGHUP:
                signals.pop(0)
                print("disagg up: SIGHUP: reloading the configuration", flush=True)
                self.reload(Reload())
            if signals:
                return 0
            self.restart_exited()
            for ident, request in take_requests(self.run_dir):
                answer = (ControlAnswer(ok=False, message=request) if isinstance(request, str)
                          else self.handle(request))
                answer_request(self.run_dir, ident, answer)
            if all(p.given_up or p.retired for p in self.processes):
                print("disagg up: every process was left down; stopping", flush=True)
                return 1

    def restart_exited(self) -> None:
        policy = self.config.restarts
        for process in self.processes:
            child = self.children.get(process.name)
            if child is None or child.poll() is None or process.given_up or process.retired:
                continue
            budget = self.budgets[process.name]
            if not budget.allow(time.monotonic()):
                process.given_up = f"exited {budget.recent_exits} times within {policy.window_seconds:g} s"
                print(f"disagg up: {process.name} exited ({child.returncode}) {budget.recent_exits} times "
                      f"within {policy.window_seconds:g} s: leaving it down, the rest keep serving; "
                      f"see {process.log}", flush=True)
            else:
                process.restarts += 1
                print(f"disagg up: {process.name} exited ({child.returncode}); restarting", flush=True)
                self.children[process.name] = _start(self.run_dir, process)
            write_state(self.run_dir, self.state)

    def handle(self, request: ControlRequest) -> ControlAnswer:
        if isinstance(request, RetireWorkers):
            return self.retire(request.names)
        if isinstance(request, AddWorkers):
            return self.add(request.pool, request.count)
        return self.reload(request)

    def _workers(self) -> dict[str, ProcessRecord]:
        return {p.name: p for p in self.processes if p.pool is not None}

    def retire(self, names: list[str]) -> ControlAnswer:
        workers = self._workers()
        unknown = [name for name in names if name not in workers]
        if unknown:
            return ControlAnswer(ok=False, message=f"no worker {', '.join(unknown)} in this deployment "
                                                   f"(workers: {', '.join(workers)})")
        for name in names:
            workers[name].retired = "drained"
            child = self.children[name]
            # A thread waits out its grace period: the rounds (restarts, requests) go on meanwhile.
            threading.Thread(target=stop_process, args=(child, STOP_SECONDS), daemon=True).start()
        self._write_orchestrator_config()
        write_state(self.run_dir, self.state)
        print(f"disagg up: stopping {', '.join(names)} (drained; not restarted)", flush=True)
        return ControlAnswer(ok=True, message=f"stopping {', '.join(names)}")

    def _write_orchestrator_config(self) -> None:
        """``orchestrator.json`` with the static workers still serving: what a restarted orchestrator reads."""
        retired = {p.url for p in self.processes if p.retired}
        orch = self.plan.orchestrator
        config = dataclasses.replace(orch.config, workers=tuple(w for w in orch.config.workers
                                                                if w.url not in retired))
        self.plan = dataclasses.replace(self.plan, orchestrator=dataclasses.replace(orch, config=config))
        self.plan.write_orchestrator_config()

    def add(self, pool: str, count: int) -> ControlAnswer:
        from disagg.core_partition import available_cores, engine_threads
        from disagg.deploy_plan import local_worker

        if pool not in ("ctx", "gen") or count < 1:
            return ControlAnswer(ok=False, message=f"pool must be ctx or gen and count >= 1, got {pool!r}, {count}")
        register: dict[str, object] = {"--register-url": self.state.url}
        api_key = self.plan.orchestrator.config.api_key
        if api_key is not None:
            write_secret(self.run_dir / API_KEY_FILE, api_key)
            register["--register-api-key-file"] = str(self.run_dir / API_KEY_FILE)
        threads = engine_threads(self.config, available_cores()).get(f"{pool}-0")
        started: dict[str, str] = {}
        for _ in range(count):
            taken = {_index(p.name) for p in self.processes if p.pool == pool and not p.retired}
            index = next(i for i in range(len(taken) + 1) if i not in taken)
            launch = local_worker(self.config, self.run_dir, Path(self.plan.model), pool, index, threads, register)
            record = ProcessRecord(name=launch.name, url=launch.url, argv=list(launch.argv), pool=pool)
            self.processes[:] = [p for p in self.processes if p.name != launch.name]  # a retired namesake
            self.processes.insert(len(self.processes) - 1, record)  # before the orchestrator
            self.budgets[record.name] = RestartBudget(self.config.restarts.max_restarts,
                                                      self.config.restarts.window_seconds)
            self.children[record.name] = _start(self.run_dir, record)
            started[record.name] = record.url
        write_state(self.run_dir, self.state)
        print(f"disagg up: started {', '.join(started)} (they register with the orchestrator)", flush=True)
        return ControlAnswer(ok=True, message=f"started {', '.join(started)}", started=started)

    def reload(self, request: Reload) -> ControlAnswer:
        from disagg.live_settings import live_settings, reload_config

        orch = self.plan.orchestrator
        result = reload_config(self.config, request.config or self.config.source, self.run_dir, self.state.url,
                               orch.config.api_key)
        if result.ok and result.running != self.config:
            self.config = result.running
            config = orch.config.with_live(live_settings(self.config))  # what a restarted orchestrator reads
            self.plan = dataclasses.replace(self.plan, orchestrator=dataclasses.replace(orch, config=config))
            self.plan.write_orchestrator_config()
        for line in result.lines:
            print(f"disagg up: reload: {line}", flush=True)
        return ControlAnswer(ok=result.ok, message="\n".join(result.lines), needs_restart=list(result.needs_restart))

    def stop_all(self) -> None:
        # The orchestrator goes first and drains: its in-flight requests finish on the still-running
        # workers, and no new one is routed to a stopping worker. Then the workers, all at once.
        orchestrator = self.children.pop(self.plan.orchestrator.name, None)
        if orchestrator is not None:
            stop_process(orchestrator, self.state.orchestrator_stop_seconds)
        # Its serving processes stop with it; any that outlived a keeper killed before (and was not
        # adopted) is recorded in its state dir.
        sweep(self.plan.orchestrator.config.state_dir, self.state.orchestrator_stop_seconds)
        stop_processes(list(self.children.values()), STOP_SECONDS)

