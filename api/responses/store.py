"""Stored responses (``store: true``) with a TTL, in one SQLite file, and the clients that reach it.

On a worker the launcher owns the store (docs/architecture.md, "Launcher-owned state"): it serves
``GET|DELETE /v1/responses/{id}`` from it (attached frontends forward
those), and every frontend's ``POST /v1/responses`` reads the conversation
it continues and writes its answer through a ``ResponsesClient``: the
launcher's own (``LocalResponses``) or, on an attached frontend, one over the
launcher's admin socket (``LauncherResponses``, to the admin-only routes of
``api.responses.routes``). The orchestrator's processes share one file
in its state directory (SQLite's own locking; WAL, small transactions), so a
conversation continues through any of them, on any worker.

A record expires ``ttl_seconds`` after it was written; expired rows are
dropped on the next write and never returned.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path
from typing import Protocol

import httpx
import msgspec

from api.errors import LauncherUnavailableError
from api.responses.schemas import StoredResponse

__all__ = ["ResponseStore", "ResponsesClient", "LocalResponses", "LauncherResponses", "RESPONSES_FILE",
           "DEFAULT_TTL_SECONDS", "ADMIN_PREFIX"]

RESPONSES_FILE = "responses.sqlite3"
DEFAULT_TTL_SECONDS = 7 * 24 * 3600.0
ADMIN_PREFIX = "/_admin/responses/"  # launcher-only, over its admin socket (never forwarded, never on TCP)
BUSY_TIMEOUT_SECONDS = 5.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, expires_at REAL NOT NULL, record BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS responses_by_expiry ON responses (expires_at);
"""
_decode = msgspec.json.Decoder(StoredResponse).decode


class ResponseStore:
    """Synchronous and short; opened on first use (the directory may not exist at construction)."""

    def __init__(self, path: str | Path, ttl_seconds: float = DEFAULT_TTL_SECONDS) -> None:
        self.path = str(path)
        self.ttl_seconds = ttl_seconds
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None,
                                   check_same_thread=False)
            if self.path != ":memory:":
                conn.execute("PRAGMA journal_mode=WAL")
                # No fsync per write (a request's latency): a crash of the machine may lose the last
                # few responses, never corrupt the file.
                conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
            self._conn = conn
        return self._conn

    def put(self, record: StoredResponse, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            conn = self._connection()
            conn.execute("DELETE FROM responses WHERE expires_at <= ?", (now,))
            conn.execute("INSERT OR REPLACE INTO responses (id, expires_at, record) VALUES (?, ?, ?)",
                         (record.id, now + self.ttl_seconds, msgspec.json.encode(record)))

    def get(self, response_id: str, now: float | None = None) -> StoredResponse | None:
        now = time.time() if now is None else now
        with self._lock:
            row = self._connection().execute("SELECT record FROM responses WHERE id = ? AND expires_at > ?",
                                             (response_id, now)).fetchone()
        return None if row is None else _decode(row[0])

    def delete(self, response_id: str, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        with self._lock:
            return self._connection().execute("DELETE FROM responses WHERE id = ? AND expires_at > ?",
                                              (response_id, now)).rowcount == 1

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


class ResponsesClient(Protocol):
    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def put(self, record: StoredResponse) -> None: ...

    async def delete(self, response_id: str) -> bool: ...


class LocalResponses:
    """The store in this process (the launcher, a plain app, an orchestrator process)."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def get(self, response_id: str) -> StoredResponse | None:
        return await asyncio.to_thread(self.store.get, response_id)

    async def put(self, record: StoredResponse) -> None:
        await asyncio.to_thread(self.store.put, record)

    async def delete(self, response_id: str) -> bool:
        return await asyncio.to_thread(self.store.delete, response_id)


class LauncherResponses:
    """An attached frontend's way to the launcher's store: its admin socket."""

    def __init__(self, socket_path: str, timeout: float = 10.0) -> None:
        self._client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path, retries=0),
                                         base_url="http://launcher", timeout=timeout)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _call(self, method: str, response_id: str, body: bytes = b"") -> httpx.Response:
        try:
            return await self._client.request(method, ADMIN_PREFIX + response_id, content=body)
        except httpx.HTTPError as exc:
            raise LauncherUnavailableError(f"the worker's launcher holds stored responses and did not answer: "
                                           f"{type(exc).__name__}: {exc}") from exc

    async def get(self, response_id: str) -> StoredResponse | None:
        response = await self._call("GET", response_id)
        if response.status_code == 404:
            return None
        _check(response)
        return _decode(response.content)

    async def put(self, record: StoredResponse) -> None:
        _check(await self._call("PUT", record.id, msgspec.json.encode(record)))

    async def delete(self, response_id: str) -> bool:
        response = await self._call("DELETE", response_id)
        if response.status_code == 404:
            return False
        _check(response)
        return True


def _check(response: httpx.Response) -> None:
    if response.status_code >= 300:
        raise LauncherUnavailableError(f"the launcher's response store answered {response.status_code}")
