"""BatchRunner: runs Message Batches (a launcher's through its engine, the orchestrator's through its flow).

One dispatcher task serves open batches oldest first, each in request order,
with at most ``max_in_flight`` requests running at once (batch traffic never
takes more of the engine than that; interactive requests queue beside it).
Each request runs through its ``BatchExecutor`` (``api.batches.executor``:
the same non-streaming path as ``POST /v1/messages``), and its result is
written as soon as it finishes.

Policies (documented once, here):

- ``params`` are validated when the request runs, exactly as /v1/messages
  validates a body; an invalid one is an ``errored`` result carrying the
  error /v1/messages would have answered (Anthropic validates params
  asynchronously too). Only the envelope is checked at create time.
- Restart: a request is ``pending`` in the store until its result is
  written, so requests that were running when the worker stopped run again
  when the next runner starts, and a ``canceling`` batch finishes canceling.
- A dead engine fails nothing: the request stays pending (re-run after the
  worker restarts) and dispatching waits for the engine (``is_ready``).
- Cancel: the batch turns ``canceling``; requests not started become
  ``canceled``; running ones are cancelled, which aborts them in the engine
  (leaving ``Generation.pieces`` aborts the engine request), and become
  ``canceled`` unless they finished first. Then the batch ends.
- Expiry: requests still pending when their batch is dispatched after its
  ``expires_at`` become ``expired``.
- Request counts move as requests finish (Anthropic's move only at the end;
  the sum is always the number of requests).
- ``on_end(batch_id)``, if given, is awaited once a batch has ended (the
  OpenAI Batches write their output files then); its failure is logged and
  leaves the batch ended (whoever owns ``on_end`` redoes it at its start).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from api.batches.executor import BatchExecutor
from api.batches.store import DEFAULT_TTL_SECONDS, BatchRecord, BatchStore

__all__ = ["BatchRunner", "DEFAULT_MAX_IN_FLIGHT"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_IN_FLIGHT = 32
ENGINE_WAIT_SECONDS = 0.5
DISPATCH_RETRY_SECONDS = 1.0


class BatchRunner:
    """Owns ``store`` (closed by ``close()``); use as ``async with runner:`` or start()/close()."""

    def __init__(self, store: BatchStore, executor: BatchExecutor, *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                 ttl_seconds: float = DEFAULT_TTL_SECONDS, clock: Callable[[], float] = time.time,
                 on_end: Callable[[str], Awaitable[None]] | None = None) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.store = store
        self.executor = executor
        self.max_in_flight = max_in_flight
        self.ttl_seconds = ttl_seconds
        self.clock = clock
        self.on_end = on_end
        self._slots = asyncio.Semaphore(max_in_flight)
        self._wake = asyncio.Event()
        self._running: dict[str, dict[int, asyncio.Task[None]]] = {}  # batch id -> request index -> task
        self._dispatched: set[str] = set()  # every pending request of these was started (or settled)
        self._canceling: set[str] = set()
        self._current: str | None = None  # the batch being dispatched
        self._background: set[asyncio.Task[Any]] = set()
        self._dispatcher: asyncio.Task[None] | None = None
        self._closing = False

    async def __aenter__(self) -> BatchRunner:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        self._dispatcher = asyncio.create_task(self._dispatch_loop(), name="batch-dispatcher")

    async def close(self) -> None:
        """Stop at once: running requests are cancelled (aborted in the engine) and stay pending."""
        self._closing = True
        tasks = [task for running in self._running.values() for task in running.values()]
        tasks += [*self._background, *([self._dispatcher] if self._dispatcher else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(self.store.close)

    @property
    def num_in_flight(self) -> int:
        return sum(len(running) for running in self._running.values())

    # -- what the routes call ------------------------------------------------------------------------

    async def create(self, items: list[tuple[str, bytes]],
                     settled: Mapping[int, tuple[str, bytes]] | None = None, batch_id: str | None = None) -> BatchRecord:
        """``settled``, ``batch_id``: ``BatchStore.create``'s."""
        record = await asyncio.to_thread(self.store.create, items, self.clock(), self.ttl_seconds, settled, batch_id)
        self._wake.set()
        return record

    async def cancel(self, batch_id: str) -> BatchRecord | None:
        record = await asyncio.to_thread(self.store.begin_cancel, batch_id, self.clock())
        if record is None or record.processing_status != "canceling":
            return record
        self._canceling.add(batch_id)
        running = self._running.get(batch_id, {})
        for task in running.values():
            task.cancel()
        if not running and self._current != batch_id:
            await self._finish(batch_id)  # nothing runs and the dispatcher is elsewhere: end it now
            return await asyncio.to_thread(self.store.get, batch_id)
        return record

    # -- dispatching ---------------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                for batch_id in await asyncio.to_thread(self.store.open_batch_ids):
                    if batch_id not in self._dispatched:
                        self._current = batch_id
                        try:
                            await self._dispatch_batch(batch_id)
                        finally:
                            self._current = None
            except Exception:  # a dead dispatcher would stall every batch in silence
                logger.exception("batch dispatch failed; retrying in %.1f s", DISPATCH_RETRY_SECONDS)
                await asyncio.sleep(DISPATCH_RETRY_SECONDS)
                continue
            await self._wake.wait()

    async def _dispatch_batch(self, batch_id: str) -> None:
        record = await asyncio.to_thread(self.store.get, batch_id)
        if record is None or record.processing_status == "ended":
            return
        running = self._running.setdefault(batch_id, {})
        if record.processing_status == "canceling":
            self._canceling.add(batch_id)  # e.g. canceled before a restart
        for idx in await asyncio.to_thread(self.store.pending_indices, batch_id):
            while not self.executor.is_ready():
                await asyncio.sleep(ENGINE_WAIT_SECONDS)
            await self._slots.acquire()
            if batch_id in self._canceling:
                self._slots.release()
                break
            if self.clock() >= record.expires_at:
                self._slots.release()
                await asyncio.to_thread(self.store.expire_pending, batch_id, set(running))
                break
            task = asyncio.create_task(self._run_request(batch_id, idx), name=f"{batch_id}[{idx}]")
            running[idx] = task
            task.add_done_callback(functools.partial(self._request_done, batch_id, idx))
        self._dispatched.add(batch_id)
        if not running:
            await self._finish(batch_id)

    def _request_done(self, batch_id: str, idx: int, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:  # retrieved here, not left to the GC's log
            logger.error("batch %s request %d failed; it stays pending", batch_id, idx, exc_info=task.exception())
        self._slots.release()
        running = self._running[batch_id]
        del running[idx]
        if not running and batch_id in self._dispatched and not self._closing:
            task = asyncio.create_task(self._finish(batch_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _finish(self, batch_id: str) -> None:
        if await asyncio.to_thread(self.store.end_if_done, batch_id, self.clock()):
            self._running.pop(batch_id, None)
            self._dispatched.discard(batch_id)
            self._canceling.discard(batch_id)
            if self.on_end is not None:
                try:
                    await self.on_end(batch_id)
                except Exception:  # the batch has ended all the same; on_end's owner retries at its start
                    logger.exception("batch %s ended, but its end hook failed", batch_id)

    # -- one request ---------------------------------------------------------------------------------

    async def _run_request(self, batch_id: str, idx: int) -> None:
        params = await asyncio.to_thread(self.store.request_params, batch_id, idx)
        outcome = await self.executor.execute(params, f"{batch_id}[{idx}]")
        if outcome is None:
            return  # left pending: it runs again after a restart
        state, result = outcome
        await asyncio.to_thread(self.store.record_result, batch_id, idx, state, result)
