"""The worker registry: static workers, self-registered workers with a TTL, health state.

Owned by the orchestrator's leader alone (see ``orchestrator.state``); the other
processes see its snapshots. Pure bookkeeping with an injected clock, so
the TTL and threshold rules are unit-tested without sleeping.

A worker is in the rotation iff it is ``healthy``: it becomes healthy after
``healthy_threshold`` consecutive good health checks and leaves after
``unhealthy_threshold`` consecutive bad ones. A registered worker that sends
no heartbeat for ``registration_ttl_seconds`` is removed; registering again
(same URL -> same worker id) brings it back, unhealthy until checked.

A *draining* worker (``disagg drain``) stays in the registry and in health
checks but gets no new request: routing skips it. Drains are kept by URL, so a
worker that registers again (after a TTL expiry, a restart) is still drained;
only ``undrain`` or its deregistration ends one.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import msgspec

from orchestrator.config import WORKER_ROLES, HealthConfig
from workers.http_protocol import Phase, Role

__all__ = ["WorkerRecord", "Registry", "RegistryError"]


MAX_WORKERS = 4096


class RegistryError(ValueError):
    """A registration request is invalid (bad role or URL); ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class WorkerRecord(msgspec.Struct, kw_only=True):
    worker_id: str
    role: Role
    url: str
    static: bool
    kv_endpoint: str | None = None
    healthy: bool = False
    degraded: bool = False
    """Its last /health said ``degraded``: serving, on fewer frontends than configured."""
    num_failures: int = 0
    """Consecutive failed health checks."""
    num_successes: int = 0
    """Consecutive good health checks."""
    last_seen: float = 0.0
    """time.time() of the last heartbeat (registered) or registration."""
    block_size: int | None = None
    hash_seed: int | None = None
    max_model_len: int | None = None
    """From /worker_info; None = not known yet."""
    vocab_size: int | None = None
    """The engine's vocabulary (token ids a prompt may hold), from /worker_info; None = not known yet."""
    clock_offset: float | None = None
    """Worker clock minus ours, seconds (from /worker_info's server_time); None = unknown."""
    last_error: str | None = None
    draining: bool = False
    """Drained by an operator: routed nothing new; its in-flight requests finish."""

    def serves(self, phase: Phase) -> bool:
        return self.role == Role.BOTH or str(self.role) == str(phase)  # a StrEnum or its value alike


class Registry:
    def __init__(self, health: HealthConfig, clock: Callable[[], float] = time.time,
                 max_workers: int = MAX_WORKERS) -> None:
        self.health = health
        self.max_workers = max_workers
        self.clock = clock
        self.workers: dict[str, WorkerRecord] = {}
        self.drained_urls: set[str] = set()
        """Drains by URL: they outlive a record (a worker that registers again is still drained)."""
        self.version = 0
        """Bumped on every change that the other processes must see."""

    def _changed(self) -> None:
        self.version += 1

    def _by_url(self, url: str) -> WorkerRecord | None:
        return next((w for w in self.workers.values() if w.url == url), None)

    def add_static(self, role: str, url: str) -> WorkerRecord:
        url = url.rstrip("/")
        record = WorkerRecord(worker_id=f"static-{len(self.workers)}", role=Role(role), url=url, static=True,
                              draining=url in self.drained_urls)
        self.workers[record.worker_id] = record
        self._changed()
        return record

    def register(self, role: str, url: str, kv_endpoint: str | None = None,
                 worker_id: str | None = None) -> WorkerRecord:
        if role not in WORKER_ROLES:
            raise RegistryError(f"role must be one of {', '.join(WORKER_ROLES)}, got {role!r}", "role")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise RegistryError(f"url must be an http(s) URL, got {url!r}", "url")
        url = url.rstrip("/")
        record = self._by_url(url)
        if record is not None and (record.role != role or record.kv_endpoint != kv_endpoint):
            del self.workers[record.worker_id]  # the same address came back as a different worker
            record = None
        if record is None and len(self.workers) >= self.max_workers:
            # Every worker is health-checked each interval: a flood of registrations must not
            # turn the leader into a request amplifier.
            raise RegistryError(f"the registry holds {len(self.workers)} workers, the most it accepts; "
                                "deregister one or wait for a registration to expire", "url")
        if record is None:
            record = WorkerRecord(worker_id=worker_id or f"w-{uuid.uuid4().hex[:12]}", role=Role(role), url=url,
                                  static=False, kv_endpoint=kv_endpoint, draining=url in self.drained_urls)
            self.workers[record.worker_id] = record
        record.last_seen = self.clock()
        self._changed()
        return record

    def heartbeat(self, worker_id: str) -> bool:
        record = self.workers.get(worker_id)
        if record is None:
            return False
        record.last_seen = self.clock()  # not a published change: only the owner expires workers
        return True

    def deregister(self, worker_id: str) -> bool:
        record = self.workers.pop(worker_id, None)
        if record is None:
            return False
        self.drained_urls.discard(record.url)  # a new worker at this address later is not drained
        self._changed()
        return True

    def find(self, worker: str) -> WorkerRecord | None:
        """A worker by its id or its URL."""
        return self.workers.get(worker) or self._by_url(worker.rstrip("/"))

    def set_draining(self, worker: str, draining: bool) -> WorkerRecord:
        """Drain (or undrain) ``worker`` (an id or a URL); RegistryError when no worker is that."""
        record = self.find(worker)
        if record is None:
            raise RegistryError(f"no worker {worker!r} (an id or URL of GET /workers)", "worker")
        (self.drained_urls.add if draining else self.drained_urls.discard)(record.url)
        if record.draining != draining:
            record.draining = draining
            self._changed()
        return record

    def expire(self) -> list[str]:
        """Drop registered workers whose heartbeat is older than the TTL; their ids."""
        deadline = self.clock() - self.health.registration_ttl_seconds
        gone = [w.worker_id for w in self.workers.values() if not w.static and w.last_seen < deadline]
        for worker_id in gone:
            del self.workers[worker_id]
        if gone:
            self._changed()
        return gone

    def report_check(self, worker_id: str, ok: bool, error: str | None = None, degraded: bool = False) -> bool:
        """Record one health check; True when the worker joined or left the rotation. ``degraded``
        (a passing check that said so) is shown, never routed on."""
        record = self.workers.get(worker_id)
        if record is None:
            return False
        if ok and record.degraded != degraded:
            record.degraded = degraded
            self._changed()
        was_healthy = record.healthy
        if ok:
            record.num_successes, record.num_failures, record.last_error = record.num_successes + 1, 0, None
            if record.num_successes >= self.health.healthy_threshold:
                record.healthy = True
        else:
            record.num_failures, record.num_successes, record.last_error = record.num_failures + 1, 0, error
            if record.num_failures >= self.health.unhealthy_threshold:
                record.healthy = False
        if record.healthy != was_healthy:
            self._changed()
            return True
        return False

    def set_info(self, worker_id: str, block_size: int | None, hash_seed: int | None,
                 kv_endpoint: str | None, clock_offset: float | None, max_model_len: int | None = None,
                 vocab_size: int | None = None) -> None:
        record = self.workers.get(worker_id)
        if record is None:
            return
        record.block_size, record.hash_seed, record.clock_offset = block_size, hash_seed, clock_offset
        record.max_model_len, record.vocab_size = max_model_len, vocab_size
        if kv_endpoint is not None:
            record.kv_endpoint = kv_endpoint
        self._changed()

    def snapshot(self) -> list[WorkerRecord]:
        return sorted(self.workers.values(), key=lambda w: w.worker_id)
