"""One deployment plan: every process a ``DeployConfig`` starts, with its command line, built in one place.

A ``DeployPlan`` is what either launcher executes:

- ``workers``: one ``WorkerLaunch`` per worker (pool, index, port, TP size,
  the ``disagg serve`` argv); the ctx pool first, then gen;
- ``orchestrator``: its argv and its ``OrchestratorConfig`` (the YAML's
  ``orchestrator:`` section; the static workers, when the launcher knows
  their URLs up front);
- ``setup``: commands that run once before any process (Slurm only).

``local_plan`` is what ``disagg up`` starts on this machine
(``disagg.deployment``: one ``Popen`` per process, the orchestrator config
written before it starts). ``slurm_plan`` is what one Slurm job runs
(``disagg.slurm_deployment`` renders it as ``srun`` steps; the job's setup
step, ``python -m disagg.orchestrator_plan``, builds the same plan on the
node to write the orchestrator config). The launchers differ only in what
this module says they differ in: where workers listen, how they find the
orchestrator (static list vs registration through ``slurm.step``), and the
interpreter's name. Building a plan writes nothing; a local plan picks a free
port for what the YAML leaves unset.

Torch-free and light: the Slurm setup step imports it on a CPU node.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from disagg.serve_settings import render_flags
from orchestrator.config import OrchestratorConfig, OrchestratorSettings, StaticWorker
from orchestrator.prometheus_sd import TARGETS_DIR
from slurm.plan import RUN_DIR as SLURM_RUN_DIR  # the job's run dir, filled in by the batch script
from slurm.rendezvous import WORKER_KEY_FILE

if TYPE_CHECKING:
    from disagg.deploy_config import DeployConfig
    from slurm.placement import WorkerPlacement

__all__ = ["WorkerLaunch", "OrchestratorLaunch", "DeployPlan", "local_plan", "local_worker", "slurm_plan", "orchestrator_config",
           "ORCHESTRATOR_CONFIG_FILE", "KEY_FILE", "API_KEY_FILE", "WORKER_KEY_FILE", "write_secret", "api_headers",
           "write_scrape_config", "SLURM_PYTHON", "SLURM_RUN_DIR"]

ORCHESTRATOR_CONFIG_FILE = "orchestrator.json"
ORCHESTRATOR_STATE_DIR = "orchestrator"
"""The orchestrator's state directory in a run dir (its processes are recorded there: ``down`` sweeps them)."""
KEY_FILE = "cluster.key"
API_KEY_FILE = "api.key"
"""The orchestrator's API key (mode 0600), when it has one: for the workers ``disagg scale`` registers
and for Prometheus' scrapes of the orchestrator."""
SLURM_PYTHON = "python"
"""The interpreter Slurm steps run: the one ``slurm.env_setup`` puts first on PATH (or the submitter's PATH)."""


@dataclass(frozen=True)
class WorkerLaunch:
    """One worker (a launcher, its engine, its frontends) as the launcher starts it."""

    name: str
    """``<pool>-<index>``: its log (``<run dir>/logs/<name>.log``, under either launcher), its state dir,
    its Slurm step."""
    pool: str
    """ctx | gen: the YAML's pool."""
    index: int
    role: str
    """What it serves as (the pool's ``role``, by default the pool's name)."""
    host: str
    port: int
    argv: tuple[str, ...]
    tensor_parallel_size: int = 1
    placement: WorkerPlacement | None = None
    """Slurm: its nodes, GPUs and tasks in the allocation."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

@dataclass(frozen=True)
class OrchestratorLaunch:
    argv: tuple[str, ...]
    host: str
    port: int
    config: OrchestratorConfig

    name: ClassVar[str] = "orchestrator"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class DeployPlan:
    launcher: str
    """local | slurm."""
    run_dir: str
    """A path, or ``SLURM_RUN_DIR`` in a plan rendered before the job has one."""
    model: str
    workers: tuple[WorkerLaunch, ...]
    orchestrator: OrchestratorLaunch
    setup: tuple[tuple[str, ...], ...] = ()

    @property
    def processes(self) -> tuple[WorkerLaunch | OrchestratorLaunch, ...]:
        """Every worker, then the orchestrator: the order they start in (and stop in reverse)."""
        return (*self.workers, self.orchestrator)

    def write_orchestrator_config(self) -> Path:
        """``<run dir>/orchestrator.json``, what the orchestrator's argv names."""
        if self.run_dir == SLURM_RUN_DIR:
            raise ValueError("this plan's run dir is a placeholder; build it with the job's run dir")
        path = Path(self.run_dir) / ORCHESTRATOR_CONFIG_FILE
        # 0600: it holds the API key. Replaced whole, so a reader never sees half a file.
        tmp = path.with_name(f".{ORCHESTRATOR_CONFIG_FILE}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.orchestrator.config.to_json())
        os.replace(tmp, path)
        return path


def write_secret(path: Path, text: str) -> None:
    """``path`` holding ``text``, readable by its owner only (mode 0600 from its creation)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def api_headers(run_dir: Path) -> dict[str, str]:
    """What a CLI command presents to the orchestrator of the deployment in ``run_dir``: its API key
    (from ``orchestrator.json``, written by either launcher), or nothing when it has none."""
    try:
        api_key = json.loads((run_dir / ORCHESTRATOR_CONFIG_FILE).read_text()).get("api_key")
    except (OSError, ValueError):
        return {}
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def write_scrape_config(config: DeployConfig, run_dir: Path) -> None:
    """``<run dir>/prometheus.yml`` (``orchestrator.prometheus_sd``), its jobs presenting the worker key
    and, when the deployment has one, the API key, which goes to ``api.key`` for that."""
    from orchestrator.prometheus_sd import write_prometheus_config

    api_key = config.orchestrator.api_key
    if api_key is not None:
        write_secret(run_dir / API_KEY_FILE, api_key)
    write_prometheus_config(run_dir, config.name, config.prometheus.scrape_interval_seconds,
                            orchestrator_key_file=None if api_key is None else str(run_dir / API_KEY_FILE),
                            worker_key_file=str(run_dir / WORKER_KEY_FILE))


def orchestrator_config(config: DeployConfig, *, model: Path | str, state_dir: Path | str, host: str, port: int,
                        workers: tuple[StaticWorker, ...] = (), targets_dir: Path | str | None = None,
                        worker_key_file: Path | str | None = None) -> OrchestratorConfig:
    """``config``'s orchestrator section, serving ``model`` from ``host:port``; ``targets_dir``: where
    it keeps the Prometheus target files (``<run dir>/prometheus/targets``, ``orchestrator.prometheus_sd``);
    ``worker_key_file``: the deployment's worker key (``<run dir>/worker.key``)."""
    section = {f.name: getattr(config.orchestrator, f.name) for f in fields(OrchestratorSettings)}
    return OrchestratorConfig(
        **{**section, "host": host, "port": port, "served_model_name": config.served_model_name},
        model_dir=str(model), state_dir=str(state_dir), workers=workers, default_block_size=config.engine.block_size or 16,
        access_log=config.access_log, strict_request_fields=config.strict_request_fields,
        log_format=config.log_format, tracing=config.tracing,
        prometheus_targets_dir=None if targets_dir is None else str(targets_dir),
        worker_key_file=None if worker_key_file is None else str(worker_key_file))


def _serve_argv(config: DeployConfig, pool: str, *, python: str, model: str, host: str, port: int,
                frontends: int, head: list[str], options: dict[str, object]) -> list[str]:
    """``disagg serve`` for a worker of ``pool``: the engine settings (the pool's over the top-level
    ones), then the launcher's ``options`` (``_names`` among them), then the access log."""
    role = config.pools.ctx.role if pool == "ctx" else config.pools.gen.role
    argv = [python, "-m", "disagg.cli", "serve", model, "--role", role or pool, "--host", host, "--port", str(port),
            "--num-frontends", str(frontends), *head]
    tracing = config.tracing
    return argv + render_flags({**config.engine_for(pool).serve_options(), **options,
                                "--access-log": config.access_log or None, "--log-format": config.log_format,
                                "--otlp-endpoint": tracing.otlp_endpoint,
                                "--trace-service-name": f"{tracing.service_name}-{pool}" if tracing.enabled else None})


def _names(config: DeployConfig) -> dict[str, object]:
    """What every worker of the deployment is told alike: the model's name, its tool-call format, and
    whether unknown request fields are refused."""
    return {"--served-model-name": config.served_model_name, "--tool-call-parser": config.tool_call_parser,
            "--strict-request-fields": config.strict_request_fields or None}


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_worker(config: DeployConfig, run_dir: Path, model: Path, pool_name: str, index: int,
                 threads: int | None = None, register: Mapping[str, object] | None = None) -> WorkerLaunch:
    """Worker ``<pool_name>-<index>`` as ``disagg up`` starts it here: on its pool's host, at
    ``base_port + index`` (a free port when unset), ``threads`` its engine's share of the cores;
    ``register``: the ``--register-url`` flags of a worker started after the orchestrator
    (``disagg scale``), which learns of it by registration rather than from its static list."""
    pool = config.pools.ctx if pool_name == "ctx" else config.pools.gen
    name = f"{pool_name}-{index}"
    port = pool.base_port + index if pool.base_port else _free_port(pool.host)
    argv = _serve_argv(
        config, pool_name, python=sys.executable, model=str(model), host=pool.host, port=port,
        frontends=pool.frontends, head=["--log-level", "info"],
        options={"--engine-threads": threads, "--cluster-key-file": str(run_dir / KEY_FILE),
                 "--worker-key-file": str(run_dir / WORKER_KEY_FILE),
                 "--state-dir": str(run_dir / "worker-state" / name), "--kv-host": pool.host, "--kv-port": 0,
                 "--tensor-parallel-size": pool.tensor_parallel_size, **_names(config), **(register or {})})
    return WorkerLaunch(name=name, pool=pool_name, index=index, role=pool.role or pool_name, host=pool.host,
                        port=port, argv=tuple(argv), tensor_parallel_size=pool.tensor_parallel_size)


def local_plan(config: DeployConfig, run_dir: Path, model: Path,
               threads: Mapping[str, int | None] | None = None) -> DeployPlan:
    """The processes ``disagg up`` starts here (``local_worker`` each), each engine with its share of
    the cores (``threads``, by worker name, ``disagg.core_partition``); the orchestrator knows them as
    static workers."""
    workers = [local_worker(config, run_dir, model, pool_name, index, (threads or {}).get(f"{pool_name}-{index}"))
               for pool_name, pool in (("ctx", config.pools.ctx), ("gen", config.pools.gen))
               for index in range(pool.instances)]
    settings = config.orchestrator
    port = settings.port or _free_port(settings.host)
    orch = orchestrator_config(
        config, model=model, state_dir=(run_dir / ORCHESTRATOR_STATE_DIR).resolve(), host=settings.host, port=port,
        workers=tuple(StaticWorker(w.role, w.url) for w in workers), targets_dir=(run_dir / TARGETS_DIR).resolve(),
        worker_key_file=(run_dir / WORKER_KEY_FILE).resolve())
    command = (sys.executable, "-m", "disagg.cli", "orchestrator", "--config", str(run_dir / ORCHESTRATOR_CONFIG_FILE))
    return DeployPlan(launcher="local", run_dir=str(run_dir), model=str(model), workers=tuple(workers),
                      orchestrator=OrchestratorLaunch(argv=command, host=settings.host, port=port, config=orch))


def slurm_plan(config: DeployConfig, config_path: str, run_dir: str = SLURM_RUN_DIR,
               model: str | None = None) -> DeployPlan:
    """What one Slurm job runs: workers where ``config.placement()`` puts them, listening on every
    interface and registering with the orchestrator (``slurm.step`` adds the URLs it learns on the
    node); ``model`` None: the YAML's (``tiny``: ``<run dir>/model``, which the setup step writes)."""
    from disagg.deploy_config import TINY_MODEL

    if model is None:
        model = f"{run_dir}/model" if config.model == TINY_MODEL else config.model
    workers = []
    for worker in config.placement():
        pool = config.pools.ctx if worker.pool == "ctx" else config.pools.gen
        tp = pool.tensor_parallel_size
        step = [SLURM_PYTHON, "-m", "slurm.step", "worker", "--run-dir", run_dir, "--"]
        # every task of a TP step runs this line; slurm.step says which rank it is
        argv = step + _serve_argv(
            config, worker.pool, python=SLURM_PYTHON, model=model, host="0.0.0.0", port=worker.port,
            frontends=worker.frontends, head=["--tensor-parallel-size", str(tp)] if tp > 1 else [],
            options={**_names(config), "--cluster-key-file": f"{run_dir}/{KEY_FILE}",
                     "--worker-key-file": f"{run_dir}/{WORKER_KEY_FILE}",
                     "--state-dir": f"{run_dir}/state/{worker.name}", "--kv-host": "0.0.0.0"})
        workers.append(WorkerLaunch(name=worker.name, pool=worker.pool, index=worker.index,
                                    role=pool.role or worker.pool, host="0.0.0.0", port=worker.port,
                                    argv=tuple(argv), tensor_parallel_size=tp, placement=worker))
    port = config.orchestrator.port
    orch = orchestrator_config(config, model=model, state_dir=f"{run_dir}/orchestrator", host="0.0.0.0", port=port,
                               targets_dir=f"{run_dir}/{TARGETS_DIR}", worker_key_file=f"{run_dir}/{WORKER_KEY_FILE}")
    command = (SLURM_PYTHON, "-m", "slurm.step", "orchestrator", "--run-dir", run_dir, "--port", str(port), "--",
               SLURM_PYTHON, "-m", "disagg.cli", "orchestrator", "--config", f"{run_dir}/{ORCHESTRATOR_CONFIG_FILE}")
    setup = ((SLURM_PYTHON, "-m", "disagg.orchestrator_plan", config_path, "--run-dir", run_dir),)
    return DeployPlan(launcher="slurm", run_dir=run_dir, model=model, workers=tuple(workers),
                      orchestrator=OrchestratorLaunch(argv=command, host="0.0.0.0", port=port, config=orch),
                      setup=setup)
