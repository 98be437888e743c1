"""One orchestrator process's view of the cluster, kept current from the owner's snapshots.

The owner is whichever process leads (``orchestrator.leadership``); when it
dies another takes over under a new epoch, and the link follows it: the
long poll reconnects, takes the new owner's whole state and pushes this
process's loads again; a forwarded call waits out the hand-over.

``ClusterView`` answers the routing questions (the healthy candidates of a
leg, with their load and prefix match) from the last snapshot plus this
process's own live in-flight counts; ``StateLink`` moves data to and from
the owner (``orchestrator.state``): the snapshot long poll, this process's
load (pushed when it changes, at most every ``LOAD_PUSH_SECONDS``), perf
records, and forwarded registrations. Load from the other processes is as
old as the last snapshot (tens of milliseconds), this process's is exact.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence

import httpx
import msgspec

from common.block_hash import compute_block_hashes
from orchestrator.config import LiveSettings
from orchestrator.http_client import HttpClient, UpstreamError
from orchestrator.kv_index import KVIndex
from orchestrator.registry import WorkerRecord
from orchestrator.routing import Candidate
from orchestrator.state_protocol import LoadPush, PerfPush, RequestTrace, Snapshot
from workers.http_protocol import Phase

__all__ = ["ClusterView", "StateLink", "LOAD_PUSH_SECONDS"]

log = logging.getLogger("disagg.orchestrator.view")

LOAD_PUSH_SECONDS = 0.02
FOLLOW_RETRY_SECONDS = 0.05
"""The pause before the long poll tries again after no owner answered (a hand-over takes ~0.1 s)."""
HANDOVER_SECONDS = 5.0
"""How long a forwarded call (registration, drain, settings, batches) waits for an owner to answer."""
SUSPECT_SECONDS = 2.0
"""How long a worker that just failed a request is avoided by this process."""

_ENCODER = msgspec.json.Encoder()
_SNAPSHOT = msgspec.json.Decoder(Snapshot)


class ClusterView:
    def __init__(self, process_index: int, default_block_size: int, default_hash_seed: int) -> None:
        self.process_index = process_index
        self.default_block_size = default_block_size
        self.default_hash_seed = default_hash_seed
        self.version = -1
        self.kv_version = -1
        self.workers: dict[str, WorkerRecord] = {}
        self.kv = KVIndex()
        self.others_load: dict[str, list[int]] = {}
        self.local_load: dict[str, list[int]] = {}
        self.suspects: dict[str, float] = {}
        self.load_dirty = asyncio.Event()
        self.settings_version = -1
        self.on_settings: Callable[[LiveSettings], None] | None = None
        """Called with the owner's live settings when they change (``Orchestrator.apply_settings``)."""

    def apply(self, snapshot: Snapshot) -> None:
        if snapshot.settings is not None:
            self.settings_version = snapshot.settings_version
            if self.on_settings is not None:
                self.on_settings(snapshot.settings)
        self.version = snapshot.version
        previous, self.workers = self.workers, {w.worker_id: w for w in snapshot.workers}
        for worker_id in [w for w in self.suspects if w in self.workers]:
            before = previous.get(worker_id)
            if self.workers[worker_id].healthy and (before is None or not before.healthy):
                # Back in the rotation: its health checks passed after the failure that made it
                # suspect (a restarted worker otherwise sat out the rest of the 2 s).
                del self.suspects[worker_id]
        if snapshot.kv is not None:
            self.kv.replace(snapshot.kv, snapshot.kv_lower)
            self.kv_version = snapshot.kv_version
        others: dict[str, list[int]] = {}
        for process, loads in snapshot.loads.items():
            if int(process) == self.process_index:
                continue
            for worker_id, (requests, tokens) in loads.items():
                total = others.setdefault(worker_id, [0, 0])
                total[0] += requests
                total[1] += tokens
        self.others_load = others

    def healthy(self, phase: Phase) -> list[WorkerRecord]:
        now = time.monotonic()
        return [w for w in self.workers.values()
                if w.healthy and not w.draining and w.serves(phase) and self.suspects.get(w.worker_id, 0.0) <= now]

    def has_healthy(self, phase: Phase) -> bool:
        """A worker of ``phase`` in the rotation (healthy, not drained)."""
        return any(w.healthy and not w.draining and w.serves(phase) for w in self.workers.values())

    def hashing(self, worker: WorkerRecord) -> tuple[int, int]:
        block_size = worker.block_size if worker.block_size is not None else self.default_block_size
        return block_size, worker.hash_seed if worker.hash_seed is not None else self.default_hash_seed

    def candidates(self, phase: Phase, prompt_ids: Sequence[int], exclude: set[str],
                   hashes: dict[tuple[int, int], list[int]] | None = None) -> list[Candidate]:
        """``hashes``: the prompt's block hashes by (block size, seed), filled in as computed; a
        request passes the same dict to each of its routing decisions (gen, ctx, retries)."""
        hashes = {} if hashes is None else hashes
        rows = []
        for worker in sorted(self.healthy(phase), key=lambda w: w.worker_id):
            if worker.worker_id in exclude:
                continue
            key = self.hashing(worker)
            if key not in hashes:
                hashes[key] = list(compute_block_hashes(prompt_ids, key[0], key[1])) if prompt_ids else []
            requests, tokens = self.load(worker.worker_id)
            matched, lower = self.kv.match(worker.worker_id, hashes[key])
            rows.append(Candidate(worker.worker_id, requests, tokens, matched, key[0], lower))
        return rows

    def load(self, worker_id: str) -> tuple[int, int]:
        mine = self.local_load.get(worker_id, (0, 0))
        others = self.others_load.get(worker_id, (0, 0))
        return mine[0] + others[0], mine[1] + others[1]

    def acquire(self, worker_id: str, tokens: int) -> None:
        load = self.local_load.setdefault(worker_id, [0, 0])
        load[0] += 1
        load[1] += tokens
        self.load_dirty.set()

    def release(self, worker_id: str, tokens: int) -> None:
        load = self.local_load.get(worker_id)
        if load is None:
            return
        load[0] -= 1
        load[1] -= tokens
        if load[0] <= 0:
            del self.local_load[worker_id]
        self.load_dirty.set()

    def suspect(self, worker_id: str) -> None:
        self.suspects[worker_id] = time.monotonic() + SUSPECT_SECONDS


class StateLink:
    """This process's connection to the state owner (over its Unix socket)."""

    def __init__(self, socket_path: str, view: ClusterView, push_loads: bool = True) -> None:
        self.view = view
        # Loads are pushed for the other processes' routing only (the owner's snapshot hands each
        # process the others' loads): a lone process has nobody to tell, and pushing 50 times a
        # second (with the snapshot each push wakes) was a sixth of its CPU at 300 requests/s.
        self.push_loads = push_loads
        self.client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path),
                                        base_url="http://state", timeout=httpx.Timeout(10.0, read=30.0))
        # The snapshot long poll and the load pushes: tens of calls a second, on the lean client
        # (on httpx they were ~15% of a busy orchestrator's CPU).
        self.fast = HttpClient(connect_timeout=10.0, idle_timeout=30.0, uds=socket_path)
        self.perf_queue: list[RequestTrace] = []
        self.epoch = 0
        """The owner's epoch of the last snapshot (``orchestrator.leadership``)."""
        self.first_snapshot = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._follow()), asyncio.create_task(self._push_perf())]
        if self.push_loads:
            self.tasks.append(asyncio.create_task(self._push_loads()))

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.fast.close()
        await self.client.aclose()

    async def _follow(self) -> None:
        while True:
            try:
                snapshot = await self._call("GET", f"/snapshot?after={self.view.version}"
                                                   f"&kv_after={self.view.kv_version}"
                                                   f"&settings_after={self.view.settings_version}"
                                                   f"&process={self.view.process_index}&epoch={self.epoch}")
                decoded = _SNAPSHOT.decode(snapshot)
                if decoded.epoch != self.epoch:
                    if self.epoch:
                        log.info("process %d follows a new state owner (epoch %d)", self.view.process_index,
                                 decoded.epoch)
                    self.epoch = decoded.epoch
                    self.view.load_dirty.set()  # the new owner knows nothing of this process's loads
                self.view.apply(decoded)
                self.first_snapshot.set()
            except UpstreamError as exc:
                log.debug("state owner not reachable: %s", exc)
                await asyncio.sleep(FOLLOW_RETRY_SECONDS)

    async def _push_loads(self) -> None:
        while True:
            await self.view.load_dirty.wait()
            self.view.load_dirty.clear()
            body = LoadPush(self.view.process_index, self.view.local_load, os.getpid())
            try:
                await self._call("POST", "/load", _ENCODER.encode(body))
            except UpstreamError:
                self.view.load_dirty.set()
            await asyncio.sleep(LOAD_PUSH_SECONDS)

    async def _call(self, method: str, path: str, body: bytes = b"") -> bytes:
        status, content = await self.fast.call(method, "http://state" + path, body)
        if status != 200:
            raise UpstreamError(f"the state owner answered {status} to {method} {path}")
        return content

    async def _push_perf(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            if not self.perf_queue:
                continue
            await self.flush_perf()

    async def forward(self, method: str, path: str, body: bytes,
                      headers: dict[str, str] | None = None) -> httpx.Response:
        """The owner's answer; while no owner takes the connection (a hand-over), tried again for up to
        ``HANDOVER_SECONDS`` (a refused connection never reached an owner: safe to send again)."""
        deadline = time.monotonic() + HANDOVER_SECONDS
        while True:
            try:
                return await self.client.request(method, path, content=body, headers=headers)
            except httpx.ConnectError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(FOLLOW_RETRY_SECONDS)

    async def flush_perf(self) -> None:
        """The perf records queued, to the owner (on the lean client: five pushes a second)."""
        if self.perf_queue:
            records, self.perf_queue = self.perf_queue, []
            try:
                await self._call("POST", "/perf", _ENCODER.encode(PerfPush(records)))
            except UpstreamError:  # no owner this moment (a hand-over): sent with the next push
                self.perf_queue[:0] = records[-1000:]
