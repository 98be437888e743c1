"""The Anthropic Message Batches API, owned by a worker's launcher.

Mount it on the launcher only (attached frontends forward
``/v1/messages/batches*`` to it); the runner must run for the app's life::

    runner = BatchRunner(BatchStore(state_dir / BATCHES_FILE),
                         EngineBatchExecutor(ServingContext(client, tokenizer, config)))
    routes = batch_routes(runner)        # launcher-owned routes
    async with runner: ...               # in the app's lifespan: start() ... close()

``BatchStore`` raises ``BatchStoreBusyError`` when another process holds the
file. Policies (validation, restart, cancel, expiry): ``api.batches.runner``.
"""

from __future__ import annotations

from api.batches.executor import BatchExecutor, EngineBatchExecutor
from api.batches.routes import batch_routes
from api.batches.runner import DEFAULT_MAX_IN_FLIGHT, BatchRunner
from api.batches.store import BatchRecord, BatchStore, BatchStoreBusyError

__all__ = ["BatchRunner", "BatchExecutor", "EngineBatchExecutor", "BatchStore", "BatchStoreBusyError", "BatchRecord", "batch_routes",
           "DEFAULT_MAX_IN_FLIGHT", "BATCHES_FILE"]

BATCHES_FILE = "batches.sqlite3"
