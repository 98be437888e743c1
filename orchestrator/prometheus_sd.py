"""Prometheus file-based service discovery of a deployment: who to scrape, kept current.

A deployment's run directory holds ``prometheus.yml`` (written by ``disagg
up``, local and Slurm alike) and a target directory that the orchestrator's
leader keeps current, because it alone knows every worker (static or
self-registered, ``orchestrator.registry``)::

    <run dir>/prometheus.yml                      scrape jobs disagg-orchestrator, disagg-workers (each with
                                                  the key file it presents: api.key, worker.key)
    <run dir>/prometheus/targets/orchestrator.json  [{"targets": ["host:port"], "labels": {"role": "orchestrator"}}]
    <run dir>/prometheus/targets/workers.json       one group per worker: labels role (ctx|gen|both), worker (its id)

Each target file is rewritten atomically (write a temporary file, then
``os.replace``; Prometheus re-reads a file it watches when it is replaced) and
only when its content changes: a worker registering, leaving or coming back
at another address. At shutdown both files are emptied, so a Prometheus that
outlives the deployment stops scraping it. Every server of the deployment
serves ``/prometheus/metrics``, the samples of all its processes summed, so
one target per server is enough.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

import msgspec

__all__ = ["TargetGroup", "TargetFiles", "render_prometheus_config", "write_prometheus_config", "METRICS_PATH", "TARGETS_DIR",
           "CONFIG_FILE", "prometheus_command"]

METRICS_PATH = "/prometheus/metrics"
LISTEN_ADDRESS = "127.0.0.1:9090"
"""Where the Prometheus that ``disagg status`` suggests listens."""
TARGETS_DIR = "prometheus/targets"
"""Relative to the run directory."""
CONFIG_FILE = "prometheus.yml"


class TargetGroup(msgspec.Struct):
    """One entry of a file_sd JSON file (Prometheus' own format)."""

    targets: list[str]
    labels: dict[str, str]


def _target(url: str) -> tuple[str, dict[str, str]]:
    """``host:port`` of a server URL, and the ``__scheme__`` label when it is not plain http."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port}", ({"__scheme__": "https"} if parts.scheme == "https" else {})


def _advertised_host(host: str) -> str:
    return socket.getfqdn() if host in ("0.0.0.0", "::", "") else host


class ScrapedWorker(Protocol):
    """What a target file needs of a worker: orchestrator.registry's records have it."""

    @property
    def worker_id(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def url(self) -> str: ...


class TargetFiles:
    """The two target files under ``targets_dir``; ``update`` is cheap when nothing changed."""

    def __init__(self, targets_dir: str | Path, orchestrator_host: str, orchestrator_port: int) -> None:
        self.dir = Path(targets_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.orchestrator_url = f"http://{_advertised_host(orchestrator_host)}:{orchestrator_port}"
        self._written: dict[str, bytes] = {}

    def update(self, workers: Iterable[ScrapedWorker]) -> None:
        """``workers``: registry records (``worker_id``, ``role``, ``url``)."""
        target, labels = _target(self.orchestrator_url)
        self._write("orchestrator.json", [TargetGroup([target], {"role": "orchestrator", **labels})])
        groups = []
        for worker in sorted(workers, key=lambda w: w.worker_id):
            target, labels = _target(worker.url)
            groups.append(TargetGroup([target], {"role": worker.role, "worker": worker.worker_id, **labels}))
        self._write("workers.json", groups)

    def clear(self) -> None:
        for name in ("orchestrator.json", "workers.json"):
            self._write(name, [])

    def _write(self, name: str, groups: list[TargetGroup]) -> None:
        data = msgspec.json.format(msgspec.json.encode(groups), indent=2)
        if self._written.get(name) == data:
            return
        path = self.dir / name
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        self._written[name] = data


def render_prometheus_config(run_dir: str | Path, deployment: str, scrape_interval_seconds: float, *,
                             orchestrator_key_file: str | None = None, worker_key_file: str | None = None) -> str:
    """``prometheus.yml`` for one deployment; every series gets ``deployment="<name>"``, so one
    Prometheus can scrape several deployments (merge their ``scrape_configs``). A job whose servers
    require a key presents the one in its file (``authorization``: ``Bearer <file's content>``); the
    key itself is never in this file."""
    targets = Path(run_dir).resolve() / TARGETS_DIR
    interval = f"{scrape_interval_seconds:g}s"
    jobs = []
    for job, file, key_file in (("disagg-orchestrator", "orchestrator.json", orchestrator_key_file),
                                ("disagg-workers", "workers.json", worker_key_file)):
        authorization = f"""    authorization:
      credentials_file: "{Path(key_file).resolve()}"
""" if key_file is not None else ""
        jobs.append(f"""  - job_name: {job}
    metrics_path: {METRICS_PATH}
{authorization}    file_sd_configs:
      - files: ["{targets / file}"]
        refresh_interval: 30s
    relabel_configs:
      - target_label: deployment
        replacement: "{deployment}"
""")
    return (f"# Written by `disagg up`: prometheus --config.file={Path(run_dir).resolve() / CONFIG_FILE}\n"
            f"# The targets are kept current by the orchestrator (file-based service discovery).\n"
            f"global:\n  scrape_interval: {interval}\n  evaluation_interval: {interval}\n"
            f"scrape_configs:\n" + "".join(jobs))


def write_prometheus_config(run_dir: str | Path, deployment: str, scrape_interval_seconds: float, *,
                            orchestrator_key_file: str | None = None, worker_key_file: str | None = None) -> Path:
    path = Path(run_dir) / CONFIG_FILE
    tmp = path.with_name(f".{CONFIG_FILE}.tmp")
    tmp.write_text(render_prometheus_config(run_dir, deployment, scrape_interval_seconds,
                                            orchestrator_key_file=orchestrator_key_file,
                                            worker_key_file=worker_key_file))
    os.replace(tmp, path)
    return path


def prometheus_command(run_dir: str | Path) -> str:
    """How to scrape the deployment of ``run_dir`` (what ``disagg status`` prints)."""
    run = Path(run_dir).resolve()
    # Loopback only: Prometheus listens on 0.0.0.0:9090 by default, an open door on a shared machine.
    return (f"prometheus --config.file={run / CONFIG_FILE} --storage.tsdb.path={run / 'prometheus' / 'data'} "
            f"--web.listen-address={LISTEN_ADDRESS}")
