"""How ``disagg drain``, ``undrain`` and ``scale`` change a running deployment (``Live``).

Two parties are asked, each for what it owns. The orchestrator routes: over
its API (``POST /workers/drain`` and ``/workers/undrain``, with the
deployment's API key when it has one; ``GET /cluster_info`` for each worker's
requests in flight) a drained worker gets no new request from any of its
processes. The local supervisor runs processes: over the control channel
(``disagg.supervisor_control``) it stops a drained worker for good and starts
new ones (a Slurm deployment stops a step instead: ``disagg.slurm_live``).

Drain: no new requests (every orchestrator process holds the drain before
the command goes on), then wait until the worker has no request in flight,
then (unless ``keep``) stop it (SIGTERM: it still finishes anything a slower
path handed it within its grace period) and take it off the orchestrator's
list. Stopping is the default because a drained worker that keeps running
holds its memory and cores for nothing, and ``disagg status`` would show a
worker that serves nobody; ``--keep`` is for looking at it (logs,
``/metrics``, a profile) before deciding: ``undrain`` puts it back.

Scale: more workers are started by the supervisor and join by registration;
fewer are the highest-numbered ones, drained as above.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from disagg.run_state import STOP_SECONDS, ProcessRecord
from disagg.supervisor_control import AddWorkers, ControlAnswer, ControlRequest, RetireWorkers, ask_supervisor

__all__ = ["Live", "LiveChangeError", "POLL_SECONDS"]

POLL_SECONDS = 0.2


class LiveChangeError(RuntimeError):
    """The change could not be made (or not finished); the message says what state it left."""


class Live:
    """One command's view of a local deployment: its processes, its orchestrator (with the API key),
    its supervisor."""

    def __init__(self, run_dir: Path, url: str, processes: list[ProcessRecord]) -> None:
        self.run_dir, self.processes = run_dir, processes
        from disagg.deploy_plan import api_headers

        self.http = httpx.Client(base_url=url, headers=api_headers(run_dir), timeout=httpx.Timeout(30.0, connect=5.0))

    # -- what runs ----------------------------------------------------------------------------

    def workers(self) -> list[ProcessRecord]:
        return [p for p in self.processes if p.name != "orchestrator"]

    def resolve(self, worker: str) -> tuple[str | None, str]:
        """(name or None, URL) of a worker named as ``status`` shows it or by its URL."""
        by_name = {p.name: p for p in self.workers()}
        if worker in by_name:
            if not by_name[worker].url:
                raise LiveChangeError(f"{worker} is not in the orchestrator's list (not registered, or gone)")
            return worker, by_name[worker].url
        if worker.startswith(("http://", "https://")):
            url = worker.rstrip("/")
            return next((p.name for p in self.workers() if p.url == url and not p.retired), None), url
        raise LiveChangeError(f"no worker {worker!r} in {self.run_dir} (workers: "
                              f"{', '.join(p.name for p in self.workers() if not p.retired)}; or a worker's URL)")

    def cluster(self) -> dict[str, dict[str, Any]]:
        """The orchestrator's workers by URL (``/cluster_info``: draining, healthy, in flight)."""
        response = self.http.get("/cluster_info")
        response.raise_for_status()
        return {w["url"]: w for w in response.json()["workers"]}

    def ask(self, request: ControlRequest) -> ControlAnswer:
        answer = ask_supervisor(self.run_dir, request)
        if not answer.ok:
            raise LiveChangeError(f"the supervisor refused: {answer.message}")
        return answer

    # -- drain --------------------------------------------------------------------------------

    def set_draining(self, url: str, draining: bool) -> dict[str, Any]:
        response = self.http.post("/workers/drain" if draining else "/workers/undrain", json={"worker": url})
        if response.status_code != 200:
            raise LiveChangeError(f"the orchestrator answered {response.status_code}: {response.text}")
        ack = response.json()
        if ack["processes_confirmed"] < ack["processes"]:
            print(f"  warning: {ack['processes'] - ack['processes_confirmed']} of {ack['processes']} orchestrator "
                  "processes did not confirm (down?); they hold it once they come back")
        return ack

    def drain(self, targets: list[str], keep: bool, timeout: float, force: bool = False) -> None:
        resolved = [self.resolve(target) for target in targets]
        for name, _url in resolved:
            record = next((p for p in self.workers() if p.name == name), None)
            if record is not None and record.retired:
                raise LiveChangeError(f"{name} was stopped ({record.retired}); `disagg scale` starts workers")
        if not force:
            self.check_rotation_kept({url for _, url in resolved})
        for name, url in resolved:
            self.set_draining(url, True)
            print(f"{name or url}: draining (no new requests)", flush=True)
        self.wait_idle([url for _, url in resolved], timeout)
        print(f"{', '.join(n or u for n, u in resolved)}: drained (nothing in flight)", flush=True)
        if keep:
            print("left running (--keep): `disagg undrain` puts it back", flush=True)
            return
        named = [name for name, _ in resolved if name is not None]
        for name, url in resolved:
            if name is None:
                print(f"{url}: not a process of this deployment: drained, left running (stop it yourself)")
        if named:
            self.retire(named)

    def check_rotation_kept(self, leaving: set[str]) -> None:
        """Refuse a drain that would leave a phase with no worker in the rotation: every request
        would then fail (503), the opposite of what a drain is for."""
        cluster = self.cluster()
        for phase in ("ctx", "gen"):
            serving = [w for w in cluster.values() if w["role"] in (phase, "both") and w["healthy"]
                       and not w["draining"]]
            if serving and all(w["url"] in leaving for w in serving):
                raise LiveChangeError(f"that would leave no {phase} worker in the rotation, and requests would "
                                      f"fail; start one first (`disagg scale {phase} N`), or drain with --force")

    def wait_idle(self, urls: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            cluster = self.cluster()
            busy = {url: cluster[url]["in_flight_requests"] for url in urls
                    if url in cluster and cluster[url]["in_flight_requests"] > 0}
            if not busy:
                return
            if time.monotonic() > deadline:
                raise LiveChangeError(f"still in flight after {timeout:g} s: {busy}; left draining "
                                      "(`disagg undrain` puts them back)")
            time.sleep(POLL_SECONDS)

    def retire(self, names: list[str]) -> None:
        """The supervisor stops ``names`` (drained); once gone they leave the orchestrator's list."""
        from disagg.run_dir_guard import RecordedProcess

        by_name = {p.name: p for p in self.workers()}
        self.ask(RetireWorkers(names=names))
        recorded = [RecordedProcess(n, by_name[n].pid or 0, by_name[n].start_time) for n in names]
        deadline = time.monotonic() + STOP_SECONDS + 10
        while any(p.running() for p in recorded) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        urls = {by_name[n].url for n in names}
        for worker in self.cluster().values():
            if worker["url"] in urls:  # a static worker stays listed (unhealthy) until removed
                self.http.post("/workers/deregister", json={"worker_id": worker["worker_id"]})
        print(f"{', '.join(names)}: stopped", flush=True)

    def start_workers(self, pool: str, count: int) -> dict[str, str]:
        """The supervisor starts ``count`` workers of ``pool``: their names and URLs (or the end of
        their URLs, ``:PORT``, where only the worker knows its host)."""
        return self.ask(AddWorkers(pool=pool, count=count)).started

    def undrain(self, targets: list[str]) -> None:
        for target in targets:
            name, url = self.resolve(target)
            record = next((p for p in self.workers() if p.name == name), None)
            if record is not None and record.retired:
                raise LiveChangeError(f"{name} was stopped ({record.retired}); `disagg scale` starts workers")
            self.set_draining(url, False)
            print(f"{name or url}: back in the rotation", flush=True)

    # -- scale --------------------------------------------------------------------------------

    def scale(self, pool: str, instances: int, timeout: float) -> None:
        if instances < 1:
            raise LiveChangeError(f"a pool keeps at least 1 worker, got {instances}")
        current = sorted((p for p in self.workers() if _pool(p) == pool and not p.retired),
                         key=lambda p: int(p.name.rsplit("-", 1)[1]))
        if instances == len(current):
            print(f"{pool}: already {instances} worker{'s' if instances > 1 else ''}")
            return
        if instances < len(current):
            self.drain([p.name for p in current[instances:]], keep=False, timeout=timeout)
            print(f"{pool}: {instances} worker{'s' if instances > 1 else ''}", flush=True)
            return
        started = self.start_workers(pool, instances - len(current))
        print(f"{pool}: started {', '.join(started)}; waiting for the orchestrator to see them healthy", flush=True)
        deadline = time.monotonic() + timeout
        while True:
            cluster = self.cluster()
            waiting = [name for name, url in started.items()
                       if not any(w["healthy"] for known, w in cluster.items() if known.endswith(url))]
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise LiveChangeError(f"{', '.join(waiting)} not healthy after {timeout:g} s; see "
                                      f"{self.run_dir / 'logs'}")
            time.sleep(POLL_SECONDS)
        print(f"{pool}: {instances} workers ({', '.join(started)} in the rotation)", flush=True)


def _pool(process: ProcessRecord) -> str:
    return process.pool or process.name.rsplit("-", 1)[0]
