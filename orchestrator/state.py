"""Cluster state shared by the K_o orchestrator processes: one owner, published snapshots.

The leader (``orchestrator.leadership``: whichever process holds the lock) owns
the state (``StateOwner``): the worker registry, the KV index
(it alone drains the workers' destructive ``/kv_cache_events``), health, the
in-flight load that every process reports, and the perf records. It serves
them on a Unix socket (``<state_dir>/state.sock``) with ``state_app``:

    POST /register /heartbeat /deregister   registration, forwarded verbatim by any process
    POST /drain       drain or undrain a worker; answers once every process's view holds it
    GET|POST /settings   the live settings (``LiveSettings``); a POST validates and publishes them,
                      answering once every process holds them (``disagg reload``)
    POST /load        this process's in-flight load, {worker_id: [requests, tokens]}
    POST /perf        finished requests' orchestrator timings
    GET  /perf        the records joined with the workers' timings (``orchestrator.perf``)
    GET  /snapshot?after=V&kv_after=K&settings_after=S&process=I&epoch=E   long poll: the state
                      once its version exceeds V (or after 5 s); the KV index only if its own
                      version exceeds K, the live settings only if theirs exceeds S (else null), so
                      load changes, the frequent ones, stay small. Process I asking after V has
                      applied version V: what /drain and /settings wait for. An epoch E other
                      than this owner's (a new leader) answers the whole state at once
    /v1/messages/batches*   the Message Batches (``orchestrator.batches``), replayed by any process

Every process, the leader included, learns the state the same way: a
``StateLink`` long-polls ``/snapshot`` (see ``orchestrator.view``).
So a registration made through any process is visible to all of them
within one round trip, and the KV index is published, never drained twice.
Every body is a Struct of ``orchestrator.state_protocol``, decoded with its
type: a malformed one is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from api.errors import FrontendError, InvalidRequestError, NotFoundError, http_error, openai_error_body
from common.processes import pid_alive
from orchestrator.config import LiveSettings, OrchestratorConfig
from orchestrator.kv_index import KVIndex
from orchestrator.registry import Registry, RegistryError
from orchestrator.state_protocol import (
    DrainAck,
    DrainRequest,
    LoadPush,
    Ok,
    PerfPush,
    Registration,
    RegistrationAck,
    RequestTrace,
    SettingsAck,
    Snapshot,
    WorkerIdBody,
)
from orchestrator.typed import ConfigError, from_mapping, to_mapping

if TYPE_CHECKING:
    from orchestrator.view import ClusterView

__all__ = ["StateOwner", "state_app", "SNAPSHOT_WAIT_SECONDS", "CONFIRM_SECONDS"]

SNAPSHOT_WAIT_SECONDS = 5.0
DRAINS_FILE = "drained.json"
CONFIRM_SECONDS = 5.0
"""How long /drain waits for every process to hold the change (a process that is down never does)."""

S = TypeVar("S")
_ENCODER = msgspec.json.Encoder()
_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {
    body: msgspec.json.Decoder(body) for body in (Registration, WorkerIdBody, LoadPush, PerfPush, DrainRequest)}


class StateOwner:
    def __init__(self, config: OrchestratorConfig,
                 on_workers_changed: Callable[[list[Any]], None] | None = None, epoch: int = 0,
                 seed: ClusterView | None = None) -> None:
        """``on_workers_changed(records)``: called with the registry's workers at start and whenever
        the registry changed at a ``notify`` (the Prometheus target files, ``orchestrator.prometheus_sd``).
        ``epoch``: this owner's, different at every hand-over. ``seed``: the view of the process that
        takes over from a dead leader, whose workers (and KV index) this owner carries on with."""
        self.config = config
        self.epoch = epoch
        self.registry = Registry(config.health)
        self._on_workers_changed = on_workers_changed
        self._announced_version = -1
        self.kv_index = KVIndex()
        self.loads: dict[int, dict[str, list[int]]] = {}
        self.load_pids: dict[int, int] = {}
        """The pid that pushed each process's loads: dropped once it is dead (``drop_dead_loads``)."""
        self.perf_records: collections.deque[RequestTrace] = collections.deque(maxlen=config.perf_records)
        self.worker_perf: dict[str, dict[str, Any]] = {}
        """Worker perf records by x-request-id, kept because a worker's /perf_metrics may drain."""
        self._kv_version = 0
        self._load_version = 0
        self.settings_version = 0
        self._changed = asyncio.Event()
        self.applied: dict[int, int] = {}
        """The state version each process last asked after, i.e. holds (``/snapshot?process=``)."""
        self.closing = False
        self.registry.drained_urls = _read_drains(self.drains_path)
        if seed is not None:
            self._take_over(seed)
        else:
            for worker in config.workers:
                self.registry.add_static(worker.role, worker.url)
        self._announce_workers()

    def _take_over(self, seed: ClusterView) -> None:
        now = self.registry.clock()
        for record in seed.workers.values():
            # A copy: the seed's records are replaced by the next snapshot, these are ours to change.
            record = msgspec.structs.replace(record)
            if not record.static:
                # Heartbeats are not published: the copy's last_seen may be old. A full TTL from now:
                # a live worker heartbeats within it, a dead one expires after it.
                record.last_seen = now
            self.registry.workers[record.worker_id] = record
        self.registry.version += 1
        # The blocks as published; each worker is resynchronised from its /kv_cache_snapshot at the
        # next drain (its event ids are unknown here), so events drained by the dead leader are not lost.
        self.kv_index.replace(seed.kv.export())

    @property
    def drains_path(self) -> Path:
        """The drained workers' URLs: a restarted orchestrator must not put a drained worker back in
        the rotation."""
        return Path(self.config.state_dir) / DRAINS_FILE

    def save_drains(self) -> None:
        self.drains_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.drains_path.with_name(f".{DRAINS_FILE}.tmp")
        tmp.write_bytes(msgspec.json.encode(sorted(self.registry.drained_urls)))
        tmp.replace(self.drains_path)

    def _announce_workers(self) -> None:
        if self._on_workers_changed is not None and self.registry.version != self._announced_version:
            self._announced_version = self.registry.version
            self._on_workers_changed(list(self.registry.workers.values()))

    @property
    def version(self) -> int:
        return self.registry.version + self._kv_version + self._load_version + self.settings_version

    def notify(self) -> None:
        self._announce_workers()
        self._changed.set()
        self._changed = asyncio.Event()

    def close(self) -> None:
        """Shutting down: long polls in flight and to come answer at once, so none is cancelled mid-request."""
        self.closing = True
        self.notify()

    def kv_changed(self) -> None:
        # Also bumped when a worker is forgotten: its blocks leave the published index.
        self._kv_version += 1
        self.notify()

    def set_loads(self, process: int, loads: dict[str, list[int]], pid: int = 0) -> None:
        self.loads[process] = loads
        if pid:
            self.load_pids[process] = pid
        self._load_version += 1
        self.notify()

    def drop_dead_loads(self) -> None:
        """A process that died holds no request: its counts go (nobody else would ever lower them, and
        ``least_load`` would steer away from those workers for ever)."""
        for process, pid in list(self.load_pids.items()):
            if not pid_alive(pid):
                del self.load_pids[process]
                if self.loads.get(process):
                    self.set_loads(process, {})

    def snapshot(self, kv_after: int = -1, settings_after: int = -1) -> Snapshot:
        """The state; the KV index (the large part) only when it changed after ``kv_after``, the
        live settings after ``settings_after``."""
        kv_changed = self._kv_version > kv_after
        settings = self.config.live() if self.settings_version > settings_after else None
        return Snapshot(version=self.version, kv_version=self._kv_version, workers=self.registry.snapshot(),
                        kv=self.kv_index.export() if kv_changed else None,
                        kv_lower=self.kv_index.export_lower() if kv_changed else None,
                        loads={str(p): loads for p, loads in self.loads.items()},
                        settings=settings, settings_version=self.settings_version, epoch=self.epoch)

    async def wait_newer(self, after: int, kv_after: int, settings_after: int, timeout: float) -> Snapshot:
        if self.version <= after and not self.closing:
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), timeout)
            except TimeoutError:
                pass
        return self.snapshot(kv_after, settings_after)

    def set_settings(self, data: object) -> LiveSettings:
        """Validate ``data`` (``LiveSettings`` keys; those left out keep their value; ConfigError naming
        the key) and publish the result."""
        live = from_mapping(LiveSettings, _merged(to_mapping(self.config.live()), data), "orchestrator")
        old = self.config.max_concurrent_requests
        if (old == 0) != (live.max_concurrent_requests == 0):
            raise ConfigError("orchestrator.max_concurrent_requests",
                              f"from {old} to {live.max_concurrent_requests}: to or from 0 (no limit) needs a restart")
        self.config = self.config.with_live(live)
        self.settings_version += 1
        self.notify()
        return live

    def note_applied(self, process: int, version: int) -> None:
        if 0 <= process < self.config.processes:
            self.applied[process] = version

    async def confirmed(self, version: int, timeout: float) -> int:
        """How many processes hold ``version`` (they asked for anything newer), waiting up to
        ``timeout`` for all of them."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            count = sum(1 for p in range(self.config.processes) if self.applied.get(p, -1) >= version)
            if count == self.config.processes or asyncio.get_running_loop().time() >= deadline or self.closing:
                return count
            await asyncio.sleep(0.01)

    def forget_worker(self, worker_id: str) -> None:
        self.kv_index.remove_worker(worker_id)
        self._kv_version += 1
        for loads in self.loads.values():
            loads.pop(worker_id, None)


def _read_drains(path: Path) -> set[str]:
    try:
        return set(msgspec.json.decode(path.read_bytes(), type=list[str]))
    except (OSError, msgspec.DecodeError):  # none yet (or torn): nothing drained
        return set()


def _merged(base: Any, changes: Any) -> Any:
    """``changes`` over ``base``, mapping by mapping (``{"timeouts": {"idle_seconds": 5}}`` keeps the other
    timeouts); anything but a mapping replaces, and is validated as that."""
    if not isinstance(base, dict) or not isinstance(changes, dict):
        return changes
    return {**base, **{key: _merged(base.get(key), value) for key, value in changes.items()}}


def _json(payload: msgspec.Struct, status: int = 200) -> Response:
    return Response(_ENCODER.encode(payload), status_code=status, media_type="application/json")


async def _body(request: Request, body: type[S]) -> S:
    """The request's body as ``body``; a malformed one raises msgspec's error, which names the field."""
    decoded: S = _DECODERS[body].decode(await request.body())
    return decoded


def _query_int(request: Request, name: str) -> int:
    try:
        return int(request.query_params.get(name, "-1"))
    except ValueError:
        raise InvalidRequestError(f"{name} must be an integer", param=name) from None


def _field_of(exc: msgspec.ValidationError) -> str | None:
    """The field msgspec's message names: "... - at `$.records[0]`", and for a missing one
    "Object missing required field `url`" (which has no path of its own at the top level)."""
    text = str(exc)
    path = text.rsplit(" - at `$.", 1)[1].rstrip("`") if " - at `$." in text else None
    if "missing required field `" in text:
        name = text.split("missing required field `", 1)[1].split("`", 1)[0]
        return f"{path}.{name}" if path else name
    return path


def _typed(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """``handler``'s refusals (a malformed body among them) in the OpenAI shape, naming the field (the
    orchestrator relays a registration's verbatim)."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except (msgspec.DecodeError, FrontendError, RegistryError) as exc:
            if isinstance(exc, RegistryError):
                exc = InvalidRequestError(str(exc), param=exc.param)
            elif isinstance(exc, msgspec.ValidationError):
                exc = InvalidRequestError(f"invalid request body: {exc}", param=_field_of(exc))
            error = http_error(exc)
            return Response(openai_error_body(error), status_code=error.status, media_type="application/json")

    return endpoint


def state_app(owner: StateOwner, join_perf: Callable[[StateOwner], Awaitable[list[dict[str, Any]]]],
              extra_routes: Sequence[BaseRoute] = ()) -> Starlette:
    """The owner's Unix-socket app; ``join_perf(owner) -> list`` builds GET /perf. ``extra_routes``:
    routes that the leader owns for all (the Message Batches, ``orchestrator.batches``)."""

    async def register(request: Request) -> Response:
        body = await _body(request, Registration)
        record = owner.registry.register(body.role, body.url, body.kv_endpoint, body.worker_id)
        owner.notify()
        health = owner.config.health
        return _json(RegistrationAck(record.worker_id, health.registration_ttl_seconds,
                                     health.registration_ttl_seconds / 3))

    async def heartbeat(request: Request) -> Response:
        worker_id = (await _body(request, WorkerIdBody)).worker_id
        if not owner.registry.heartbeat(worker_id):
            raise NotFoundError("unknown worker id; register again", param="worker_id")
        return _json(Ok())

    async def deregister(request: Request) -> Response:
        worker_id = (await _body(request, WorkerIdBody)).worker_id
        if not owner.registry.deregister(worker_id):
            raise NotFoundError("unknown worker id", param="worker_id")
        owner.save_drains()  # its drain, if any, ended with it
        owner.forget_worker(worker_id)
        owner.notify()
        return _json(Ok())

    async def drain(request: Request) -> Response:
        body = await _body(request, DrainRequest)
        record = owner.registry.set_draining(body.worker, body.draining)
        owner.save_drains()
        owner.notify()
        confirmed = await owner.confirmed(owner.version, CONFIRM_SECONDS)
        return _json(DrainAck(worker=record, processes_confirmed=confirmed, processes=owner.config.processes))

    async def settings_get(request: Request) -> Response:
        return _json(SettingsAck(settings=owner.config.live(), processes_confirmed=len(owner.applied),
                                 processes=owner.config.processes))

    async def settings_post(request: Request) -> Response:
        try:
            live = owner.set_settings(msgspec.json.decode(await request.body()))
        except ConfigError as exc:
            raise InvalidRequestError(str(exc), param=exc.key) from None
        confirmed = await owner.confirmed(owner.version, CONFIRM_SECONDS)
        return _json(SettingsAck(settings=live, processes_confirmed=confirmed, processes=owner.config.processes))

    async def load(request: Request) -> Response:
        body = await _body(request, LoadPush)
        owner.set_loads(body.process, body.loads, body.pid)
        return _json(Ok())

    async def perf_push(request: Request) -> Response:
        body = await _body(request, PerfPush)
        owner.perf_records.extend(body.records)  # orchestrator.perf joins them with the workers' records
        return _json(Ok())

    async def perf_get(request: Request) -> Response:
        return Response(_ENCODER.encode({"records": await join_perf(owner)}), media_type="application/json")

    async def snapshot(request: Request) -> Response:
        after, kv_after, settings_after, process, epoch = (
            _query_int(request, name) for name in ("after", "kv_after", "settings_after", "process", "epoch"))
        if epoch != owner.epoch:  # it followed another owner: its versions mean nothing here
            after = kv_after = settings_after = -1
        owner.note_applied(process, after)
        return _json(await owner.wait_newer(after, kv_after, settings_after, SNAPSHOT_WAIT_SECONDS))

    return Starlette(routes=[
        Route("/register", _typed(register), methods=["POST"]),
        Route("/heartbeat", _typed(heartbeat), methods=["POST"]),
        Route("/deregister", _typed(deregister), methods=["POST"]),
        Route("/drain", _typed(drain), methods=["POST"]),
        Route("/settings", _typed(settings_get), methods=["GET"]),
        Route("/settings", _typed(settings_post), methods=["POST"]),
        Route("/load", _typed(load), methods=["POST"]),
        Route("/perf", _typed(perf_push), methods=["POST"]),
        Route("/perf", perf_get, methods=["GET"]),
        Route("/snapshot", _typed(snapshot), methods=["GET"]),
        *extra_routes,
    ])


