"""FileStore: the OpenAI Files API's files, on disk under one directory.

``<dir>/files.sqlite3`` holds one row per file (id, name, purpose, size,
creation time); ``<dir>/files/<id>`` holds its bytes. A file's bytes are
written to a temporary name and renamed into place before its row is
committed, so a row never names a partial file; a crash in between leaves
an orphan blob, which ``FileStore`` removes when it opens. The database is
held exclusively (``open_exclusive``): one owner per state directory.

Synchronous and short like ``BatchStore``; callers on an event loop run
the methods in a thread.
"""

from __future__ import annotations

import builtins  # the method FileStore.list shadows the builtin in annotations after it
import os
import secrets
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from api.batches.store import Transaction, open_exclusive

__all__ = ["FileStore", "FileRecord", "FILES_DB", "new_file_id"]

FILES_DB = "files.sqlite3"
_BLOBS = "files"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS files_by_purpose ON files (purpose, seq);
"""
_COLUMNS = "id, filename, purpose, bytes, created_at"


@dataclass(frozen=True)
class FileRecord:
    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: float


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


class FileStore:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._blobs = self.directory / _BLOBS
        self._blobs.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = open_exclusive(self.directory / FILES_DB, _SCHEMA)
        self._remove_orphans()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _transaction(self) -> Transaction:
        return Transaction(self._lock, self._conn)

    def _remove_orphans(self) -> None:
        with self._transaction() as conn:
            known = {row[0] for row in conn.execute("SELECT id FROM files")}
        for blob in self._blobs.iterdir():
            if blob.name not in known:
                blob.unlink(missing_ok=True)

    def add(self, filename: str, purpose: str, chunks: Iterable[bytes], now: float,
            file_id: str | None = None) -> FileRecord:
        """A new file of ``chunks``' bytes; ``file_id`` given: that file, replaced if it exists (what
        lets a batch write its output file again after a crash, under the id it chose up front)."""
        file_id = file_id or new_file_id()
        partial = self._blobs / f"{file_id}.partial"
        size = 0
        try:
            with open(partial, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
                    size += len(chunk)
                out.flush()
                os.fsync(out.fileno())  # the row committed below must never name bytes a crash lost
        except BaseException:  # e.g. the upload passed its limit
            partial.unlink(missing_ok=True)
            raise
        os.replace(partial, self._blobs / file_id)
        with self._transaction() as conn:
            conn.execute("DELETE FROM files WHERE id = ?", (file_id,))
            conn.execute("INSERT INTO files (id, filename, purpose, bytes, created_at) VALUES (?, ?, ?, ?, ?)",
                         (file_id, filename, purpose, size, now))
        return FileRecord(file_id, filename, purpose, size, now)

    def get(self, file_id: str) -> FileRecord | None:
        with self._transaction() as conn:
            row = conn.execute(f"SELECT {_COLUMNS} FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else FileRecord(*row)

    def path(self, file_id: str) -> Path:
        """Where a file's bytes are (read them only after ``get`` found its row)."""
        return self._blobs / file_id

    def read(self, file_id: str) -> bytes:
        return self.path(file_id).read_bytes()

    def list(self, limit: int, after: str | None = None, purpose: str | None = None,
             newest_first: bool = True) -> tuple[builtins.list[FileRecord], bool] | None:
        """A page of files after the file ``after`` in the order asked; (page, has_more), or None for
        an unknown ``after``."""
        clauses, args = [], []
        if purpose is not None:
            clauses.append("purpose = ?")
            args.append(purpose)
        with self._transaction() as conn:
            if after is not None:
                found = conn.execute("SELECT seq FROM files WHERE id = ?", (after,)).fetchone()
                if found is None:
                    return None
                clauses.append("seq < ?" if newest_first else "seq > ?")
                args.append(found[0])
            where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
            order = "DESC" if newest_first else "ASC"
            rows = conn.execute(f"SELECT {_COLUMNS} FROM files {where} ORDER BY seq {order} LIMIT ?",
                                (*args, limit + 1)).fetchall()
        return [FileRecord(*row) for row in rows[:limit]], len(rows) > limit

    def delete(self, file_id: str) -> bool:
        with self._transaction() as conn:
            deleted = conn.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount == 1
        if deleted:
            self.path(file_id).unlink(missing_ok=True)
        return deleted
