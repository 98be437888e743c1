"""BatchStore: the launcher's Message Batches, persisted in one SQLite file.

Tables: ``batches`` (one row per batch, with its request counts kept in the
same transaction as every state change, so listing never scans requests)
and ``requests`` (one row per request: the raw ``params`` JSON, its state
and, once it left ``pending``, its ``result`` JSON exactly as a results line
carries it). A request is ``pending`` until its result is written: a worker
that dies mid-request leaves it pending, and the next runner re-runs it.

Every method is synchronous and short (one small transaction); callers on
an event loop run them in a thread (``asyncio.to_thread``). One connection,
serialized by a lock; it holds the file's lock exclusively for the store's
lifetime (one worker per state directory); WAL with small transactions.
"""

from __future__ import annotations

import builtins  # the method BatchStore.list shadows the builtin in annotations after it
import collections
import secrets
import sqlite3
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from api.batches.schemas import ProcessingStatus, RequestCounts, RequestState

__all__ = ["BatchStore", "BatchStoreBusyError", "BatchRecord", "ResultRow", "DEFAULT_TTL_SECONDS", "Transaction",
           "open_exclusive"]

DEFAULT_TTL_SECONDS = 24 * 3600.0
LOCK_TIMEOUT_SECONDS = 1.0  # Anthropic: a batch expires 24 hours after creation

_FINAL_STATES = ("succeeded", "errored", "canceled", "expired")
_CANCELED_RESULT = b'{"type":"canceled"}'
_EXPIRED_RESULT = b'{"type":"expired"}'

_SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    processing_status TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    ended_at REAL,
    cancel_initiated_at REAL,
    archived_at REAL,
    n_pending INTEGER NOT NULL,
    n_succeeded INTEGER NOT NULL DEFAULT 0,
    n_errored INTEGER NOT NULL DEFAULT 0,
    n_canceled INTEGER NOT NULL DEFAULT 0,
    n_expired INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS requests (
    batch_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    params BLOB NOT NULL,
    state TEXT NOT NULL,
    result BLOB,
    PRIMARY KEY (batch_id, idx)
);
CREATE INDEX IF NOT EXISTS requests_by_state ON requests (batch_id, state, idx);
"""

_BATCH_COLUMNS = ("id, processing_status, created_at, expires_at, ended_at, cancel_initiated_at, archived_at, "
                  "n_pending, n_succeeded, n_errored, n_canceled, n_expired")


class BatchStoreBusyError(RuntimeError):
    """Another process (another worker) holds the store's file."""


@dataclass(frozen=True)
class BatchRecord:
    id: str
    processing_status: ProcessingStatus
    created_at: float
    expires_at: float
    ended_at: float | None
    cancel_initiated_at: float | None
    archived_at: float | None
    request_counts: RequestCounts

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> BatchRecord:
        batch_id, status, created_at, expires_at, ended_at, cancel_initiated_at, archived_at = row[:7]
        return cls(batch_id, status, created_at, expires_at, ended_at, cancel_initiated_at, archived_at,
                   RequestCounts(*row[7:12]))


@dataclass(frozen=True)
class ResultRow:
    idx: int
    custom_id: str
    result: bytes
    state: RequestState = "succeeded"


def open_exclusive(path: Path, schema: str) -> sqlite3.Connection:
    """``path``'s SQLite database, held exclusively by this process for the connection's life
    (raises ``BatchStoreBusyError`` if another process holds it), ``schema`` applied."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=LOCK_TIMEOUT_SECONDS)
    try:
        # One owner per file: the exclusive lock keeps a second worker off this state directory,
        # and lets WAL keep its index in process memory (no shared memory: fine on NFS homes).
        conn.execute("PRAGMA locking_mode=EXCLUSIVE")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes
        conn.executescript(schema)
    except sqlite3.OperationalError as exc:
        conn.close()
        if "locked" in str(exc):
            raise BatchStoreBusyError(f"{path} is in use by another process: one worker per state "
                                      "directory") from exc
        raise
    return conn


class BatchStore:
    """``id_prefix``: what batch ids start with (``msgbatch_`` for Anthropic's, ``batch_`` for OpenAI's);
    ``extra_schema``: tables of the API's own in the same file, used through ``transaction()``."""

    def __init__(self, path: str | Path, id_prefix: str = "msgbatch_", extra_schema: str = "") -> None:
        self.path = Path(path)
        self.id_prefix = id_prefix
        self._lock = threading.Lock()
        self._conn = open_exclusive(self.path, _SCHEMA + extra_schema)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def transaction(self) -> Transaction:
        return Transaction(self._lock, self._conn)

    # -- batches -------------------------------------------------------------------------------------

    def create(self, items: list[tuple[str, bytes]], now: float, ttl_seconds: float = DEFAULT_TTL_SECONDS,
               settled: Mapping[int, tuple[str, bytes]] | None = None, batch_id: str | None = None) -> BatchRecord:
        """A new in-progress batch of ``(custom_id, params JSON)`` items, every request pending but
        those of ``settled``: index -> (final state, result), finished already (a line that could
        not be read, say). ``batch_id``: an id chosen by the caller (else a new one)."""
        batch_id = batch_id or self.id_prefix + secrets.token_hex(12)
        settled = settled or {}
        with self.transaction() as conn:
            conn.execute(
                "INSERT INTO batches (id, processing_status, created_at, expires_at, n_pending) "
                "VALUES (?, 'in_progress', ?, ?, ?)", (batch_id, now, now + ttl_seconds, len(items) - len(settled)))
            conn.executemany(
                "INSERT INTO requests (batch_id, idx, custom_id, params, state, result) VALUES (?, ?, ?, ?, ?, ?)",
                ((batch_id, idx, custom_id, params, *settled.get(idx, ("pending", None)))
                 for idx, (custom_id, params) in enumerate(items)))
            for state, count in collections.Counter(state for state, _ in settled.values()).items():
                column = _count_column(state)
                conn.execute(f"UPDATE batches SET {column} = {column} + ? WHERE id = ?", (count, batch_id))
            record = self._get(conn, batch_id)
        assert record is not None  # inserted above, in the same transaction
        return record

    def get(self, batch_id: str) -> BatchRecord | None:
        with self.transaction() as conn:
            return self._get(conn, batch_id)

    @staticmethod
    def _get(conn: sqlite3.Connection, batch_id: str) -> BatchRecord | None:
        row = conn.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else BatchRecord.from_row(row)

    def list(self, limit: int, before_id: str | None = None,
             after_id: str | None = None) -> tuple[list[BatchRecord], bool] | None:
        """Newest first. ``after_id``: the page of older batches after it; ``before_id``: the page of
        newer ones before it. Returns (page, has_more in that direction), or None for an unknown cursor."""
        with self.transaction() as conn:
            cursor_id = before_id if before_id is not None else after_id
            if cursor_id is None:
                rows = conn.execute(f"SELECT {_BATCH_COLUMNS} FROM batches ORDER BY seq DESC LIMIT ?",
                                    (limit + 1,)).fetchall()
            else:
                found = conn.execute("SELECT seq FROM batches WHERE id = ?", (cursor_id,)).fetchone()
                if found is None:
                    return None
                if before_id is not None:
                    rows = conn.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE seq > ? ORDER BY seq ASC "
                                        "LIMIT ?", (found[0], limit + 1)).fetchall()
                else:
                    rows = conn.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE seq < ? ORDER BY seq DESC "
                                        "LIMIT ?", (found[0], limit + 1)).fetchall()
        has_more = len(rows) > limit
        page = [BatchRecord.from_row(row) for row in rows[:limit]]
        if before_id is not None:
            page.reverse()  # fetched oldest first, nearest the cursor; shown newest first
        return page, has_more

    def delete(self, batch_id: str) -> bool:
        with self.transaction() as conn:
            conn.execute("DELETE FROM requests WHERE batch_id = ?", (batch_id,))
            return conn.execute("DELETE FROM batches WHERE id = ?", (batch_id,)).rowcount == 1

    def open_batch_ids(self) -> builtins.list[str]:
        """Batches not yet ended, oldest first (the order the runner serves them in)."""
        with self.transaction() as conn:
            rows = conn.execute("SELECT id FROM batches WHERE processing_status != 'ended' ORDER BY seq").fetchall()
        return [row[0] for row in rows]

    def begin_cancel(self, batch_id: str, now: float) -> BatchRecord | None:
        """In progress -> canceling (other states unchanged); the batch after it, None if unknown."""
        with self.transaction() as conn:
            conn.execute("UPDATE batches SET processing_status = 'canceling', cancel_initiated_at = ? "
                         "WHERE id = ? AND processing_status = 'in_progress'", (now, batch_id))
            return self._get(conn, batch_id)

    def end_if_done(self, batch_id: str, now: float) -> bool:
        """Called when none of the batch's requests is running: a canceling batch's pending requests
        become canceled; a batch with no pending request ends. True if it ended now."""
        with self.transaction() as conn:
            row = conn.execute("SELECT processing_status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or row[0] == "ended":
                return False
            if row[0] == "canceling":
                self._settle_pending(conn, batch_id, "canceled", _CANCELED_RESULT, exclude=())
            (num_pending,) = conn.execute("SELECT n_pending FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if num_pending:
                return False
            conn.execute("UPDATE batches SET processing_status = 'ended', ended_at = ? WHERE id = ?",
                         (now, batch_id))
            return True

    # -- requests ------------------------------------------------------------------------------------

    def pending_indices(self, batch_id: str) -> builtins.list[int]:
        with self.transaction() as conn:
            rows = conn.execute("SELECT idx FROM requests WHERE batch_id = ? AND state = 'pending' ORDER BY idx",
                                (batch_id,)).fetchall()
        return [row[0] for row in rows]

    def request_params(self, batch_id: str, idx: int) -> bytes:
        with self.transaction() as conn:
            (params,) = conn.execute("SELECT params FROM requests WHERE batch_id = ? AND idx = ?",
                                     (batch_id, idx)).fetchone()
        return bytes(params)

    def record_result(self, batch_id: str, idx: int, state: str, result: bytes) -> bool:
        """A pending request's final state and result line; False if it was no longer pending."""
        column = _count_column(state)
        with self.transaction() as conn:
            changed = conn.execute(
                "UPDATE requests SET state = ?, result = ? WHERE batch_id = ? AND idx = ? AND state = 'pending'",
                (state, result, batch_id, idx)).rowcount
            if changed:
                conn.execute(f"UPDATE batches SET n_pending = n_pending - 1, {column} = {column} + 1 WHERE id = ?",
                             (batch_id,))
            return changed == 1

    def expire_pending(self, batch_id: str, exclude: set[int] | frozenset[int] = frozenset()) -> int:
        """Every pending request of the batch except ``exclude`` (still running) becomes expired."""
        with self.transaction() as conn:
            return self._settle_pending(conn, batch_id, "expired", _EXPIRED_RESULT, exclude)

    @staticmethod
    def _settle_pending(conn: sqlite3.Connection, batch_id: str, state: str, result: bytes,
                        exclude: set[int] | frozenset[int] | tuple[()]) -> int:
        column = _count_column(state)
        marks = ",".join("?" * len(exclude))
        keep = f" AND idx NOT IN ({marks})" if exclude else ""
        changed = conn.execute(
            f"UPDATE requests SET state = ?, result = ? WHERE batch_id = ? AND state = 'pending'{keep}",
            (state, result, batch_id, *exclude)).rowcount
        conn.execute(f"UPDATE batches SET n_pending = n_pending - ?, {column} = {column} + ? WHERE id = ?",
                     (changed, changed, batch_id))
        return changed

    def results(self, batch_id: str, after_idx: int | None, limit: int) -> builtins.list[ResultRow]:
        """Finished requests' result lines in request order, a page at a time."""
        start = -1 if after_idx is None else after_idx
        with self.transaction() as conn:
            rows = conn.execute(
                "SELECT idx, custom_id, result, state FROM requests WHERE batch_id = ? AND idx > ? "
                "AND state != 'pending' ORDER BY idx LIMIT ?", (batch_id, start, limit)).fetchall()
        return [ResultRow(idx, custom_id, bytes(result), state) for idx, custom_id, result, state in rows]


def _count_column(state: str) -> str:
    if state not in _FINAL_STATES:
        raise ValueError(f"not a final request state: {state!r}")
    return f"n_{state}"


class Transaction:
    """The store's lock held for one transaction (BEGIN IMMEDIATE ... COMMIT, ROLLBACK on error)."""

    def __init__(self, lock: threading.Lock, conn: sqlite3.Connection) -> None:
        self.lock = lock
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self.lock.acquire()
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.release()
            raise
        return self.conn

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.conn.execute("COMMIT" if exc_type is None else "ROLLBACK")
        finally:
            self.lock.release()
