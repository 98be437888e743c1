"""Process 0's loop over the workers: health, worker info, KV events, TTL expiry.

Every ``health.interval_seconds``, for every known worker at once:
``GET /health`` (a non-200 or no answer within ``timeout_seconds`` is a
failed check; thresholds in ``orchestrator.registry``); once healthy and
until known, ``GET /worker_info`` (role details, block hashing, the clock
offset from its ``server_time``: offset = server_time - midpoint of our send
and receive times, from the probe with the shortest round trip of
``CLOCK_PROBES``, whose midpoint is the least uncertain); and ``GET /kv_cache_events`` (drained into the KV index;
a 404 means the worker does not publish events, which only disables
KV-aware scoring for it). Before a drain, a worker whose KV set is stale (never
synchronised, events lost, over its capacity, or just back in the rotation) is
resynchronised from ``GET /kv_cache_snapshot`` (``orchestrator.kv_index``).
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from api.openapi_types import Health
from orchestrator.http_client import HttpClient, UpstreamError, UpstreamTimeout
from orchestrator.registry import WorkerRecord
from orchestrator.state import StateOwner
from workers.http_protocol import WorkerInfo, decode_kv_events

__all__ = ["HealthChecker"]

log = logging.getLogger("disagg.orchestrator.health")

CLOCK_PROBES = 4  # /worker_info calls per (re)joined worker; the fastest round trip sets its offset


def _worker_info(worker: WorkerRecord, content: bytes) -> WorkerInfo:
    """A worker's ``/worker_info``; an unreadable one says nothing (the orchestrator's defaults apply)."""
    try:
        return _WORKER_INFO.decode(content)
    except msgspec.DecodeError as exc:  # ValidationError too
        log.warning("worker %s: unreadable /worker_info (%s); the configured defaults apply", worker.worker_id, exc)
        return WorkerInfo()


_WORKER_INFO = msgspec.json.Decoder(WorkerInfo)


_HEALTH = msgspec.json.Decoder(Health)


def _says_degraded(body: bytes) -> bool:
    """A worker's 200 /health body is ``{"status": "degraded", ...}`` while a frontend is left down
    (a body that is not ours, e.g. empty, says it is not)."""
    try:
        return _HEALTH.decode(body).status == "degraded"
    except msgspec.DecodeError:  # ValidationError too
        return False


class HealthChecker:
    def __init__(self, owner: StateOwner, client: HttpClient) -> None:
        """``client``: the legs' lean client (with the worker key's header), not httpx: these calls
        run several times a second per worker, and on httpx they were a tenth of a busy
        orchestrator's CPU."""
        self.owner = owner
        self.client = client
        self.timeout = owner.config.health.timeout_seconds
        self.no_events: set[str] = set()
        self.no_snapshot: set[str] = set()

    async def get(self, worker: WorkerRecord, path: str) -> tuple[int, bytes]:
        """(status, body) of ``GET path`` on ``worker`` within ``health.timeout_seconds``; raises
        UpstreamError."""
        try:
            async with asyncio.timeout(self.timeout):
                return await self.client.call("GET", worker.url + path)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no answer to GET {path} within {self.timeout:g} s") from exc

    async def run(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # one bad round must not end health checking
                log.exception("health round failed")
            await asyncio.sleep(self.owner.config.health.interval_seconds)

    async def check_all(self) -> None:
        registry = self.owner.registry
        before = registry.version
        for worker_id in registry.expire():
            log.warning("worker %s missed its heartbeats; removed", worker_id)
            self.owner.forget_worker(worker_id)
        await asyncio.gather(*(self.check(w) for w in registry.snapshot()))
        if registry.version != before:
            self.owner.notify()

    async def check(self, worker: WorkerRecord) -> None:
        try:
            status, content = await self.get(worker, "/health")
            ok, error = status == 200, f"/health answered {status}"
            degraded = ok and _says_degraded(content)
        except UpstreamError as exc:
            ok, error, degraded = False, f"{type(exc).__name__}: {exc}", False
        # A worker joining (or coming back: it may have restarted differently) is asked its info first:
        # one that refuses the deployment's worker key (/health needs none) never joins, since every
        # leg sent to it would come back 401.
        joining = ok and (worker.block_size is None or not worker.healthy)
        if joining and await self.fetch_info(worker) == 401:
            ok, error = False, "it refuses the orchestrator's worker key (401): not the deployment's worker.key"
        moved = self.owner.registry.report_check(worker.worker_id, ok, None if ok else error, degraded)
        if moved:  # joining is a state change (INFO); leaving is a fault (WARNING)
            log.log(logging.INFO if ok else logging.WARNING, "worker %s (%s) %s the rotation%s", worker.worker_id,
                    worker.url, "joined" if ok else "left", "" if ok else f": {error}")
        if not ok:
            return
        if joining:
            self.owner.kv_index.stale.add(worker.worker_id)  # with another cache, maybe
        if worker.worker_id not in self.no_events:
            await self.drain_events(worker)

    async def fetch_info(self, worker: WorkerRecord) -> int | None:
        """Reads ``/worker_info`` into the registry; the status of an answer that was not 200 (None: 200,
        or no answer)."""
        config = self.owner.config
        info: WorkerInfo | None = None
        best: tuple[float, float] | None = None  # (round trip, offset) of the fastest probe
        for _ in range(CLOCK_PROBES):
            sent = time.time()
            try:
                status, content = await self.get(worker, "/worker_info")
            except UpstreamError:
                break
            received = time.time()
            if status == 401:
                return 401
            info = _worker_info(worker, content) if status == 200 else WorkerInfo()
            if info.server_time is None:
                break  # a worker without a clock: nothing to measure
            if best is None or received - sent < best[0]:
                best = (received - sent, info.server_time - (sent + received) / 2)
        if info is None:
            return None
        offset = None if best is None else best[1]
        block_size = config.default_block_size if info.block_size is None else info.block_size
        hash_seed = config.default_hash_seed if info.hash_seed is None else info.hash_seed
        self.owner.registry.set_info(worker.worker_id, block_size, hash_seed, info.kv_endpoint, offset,
                                     info.max_model_len, info.vocab_size)
        return None

    async def drain_events(self, worker: WorkerRecord) -> None:
        try:
            status, content = await self.get(worker, "/kv_cache_events")
        except UpstreamError:
            return
        if status == 404:
            self.no_events.add(worker.worker_id)
            return
        if status != 200:
            return
        try:
            events = decode_kv_events(content)
        except msgspec.DecodeError as exc:  # ValidationError too: this worker's events are not ours to read
            log.debug("worker %s: unreadable /kv_cache_events (%s)", worker.worker_id, exc)
            return
        # A snapshot taken after this drain holds these events' effects: apply skips them by id.
        worker_id, kv_index = worker.worker_id, self.owner.kv_index
        if kv_index.needs_snapshot(worker_id):
            await self.resync(worker)
        if events and kv_index.apply(worker_id, events):
            self.owner.kv_changed()
        if worker_id in kv_index.stale:  # these events skipped ids or overflowed the pool
            await self.resync(worker)
        if kv_index.over_capacity(worker_id):  # no snapshot came: forget rather than overcount
            kv_index.clear_worker(worker_id)
            self.owner.kv_changed()
        if worker_id in self.no_snapshot:
            kv_index.stale.discard(worker_id)  # nothing to resynchronise from; its events go on

    async def resync(self, worker: WorkerRecord) -> None:
        """Adopt the worker's whole cache from ``/kv_cache_snapshot`` (a worker without it is
        left to its events, and cleared when they prove its set wrong)."""
        if worker.worker_id in self.no_snapshot:
            return
        try:
            status, content = await self.get(worker, "/kv_cache_snapshot")
        except UpstreamError:
            return  # tried again next round
        if status == 404:
            self.no_snapshot.add(worker.worker_id)
            return
        if status != 200:
            return
        snapshot = msgspec.json.decode(content, type=_KVSnapshot)
        stale = worker.worker_id in self.owner.kv_index.stale
        self.owner.kv_index.adopt_snapshot(worker.worker_id, snapshot.next_event_id, snapshot.block_hashes,
                                           snapshot.num_blocks, snapshot.lower_block_hashes)
        self.owner.kv_changed()
        if stale:
            log.info("worker %s: KV index resynchronised from its snapshot (%d blocks)", worker.worker_id,
                     len(snapshot.block_hashes))


class _KVSnapshot(msgspec.Struct):
    """``GET /kv_cache_snapshot`` (``workers.engine.kv_events.KVCacheSnapshot``, read as JSON)."""

    next_event_id: int
    block_hashes: list[int]
    num_blocks: int
    lower_block_hashes: list[int] = msgspec.field(default_factory=list)
