"""OpenAIBatchStore: what an OpenAI batch holds beyond its requests, in its ``BatchStore``'s file.

The requests (and their counts, cancel and end times) are the shared
``BatchStore``'s rows under the same batch id; this table adds the OpenAI
fields and the two steps that store has no notion of:

    stage  validating -> running -> finalized      (or validating -> failed)

``validating``: the input file is being read; ``running``: the requests
exist in the ``BatchStore`` (in progress, cancelling, or ended and waiting
for its files); ``finalized``: the output and error files are written and
``final_status`` says completed, cancelled or expired. The output and error
file ids are chosen at creation (``output_slot``, ``error_slot``), so a
finalization cut short by a crash is simply done again under the same ids.
"""

from __future__ import annotations

import builtins  # the method OpenAIBatchStore.list shadows the builtin in annotations after it
import enum
import sqlite3
from dataclasses import dataclass
from typing import Any

import msgspec

from api.batches.files import new_file_id
from api.batches.openai_schemas import BatchError, BatchStatus, BatchUsage
from api.batches.store import BatchStore

__all__ = ["OpenAIBatchStore", "OpenAIBatchRow", "Stage", "META_SCHEMA"]

META_SCHEMA = """
CREATE TABLE IF NOT EXISTS openai_batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    metadata BLOB,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    stage TEXT NOT NULL,
    output_slot TEXT NOT NULL,
    error_slot TEXT NOT NULL,
    errors BLOB,
    cancelling_at REAL,
    final_status TEXT,
    final_at REAL,
    output_file_id TEXT,
    error_file_id TEXT,
    usage BLOB
);
"""
_COLUMNS = ("id, endpoint, input_file_id, completion_window, metadata, created_at, expires_at, stage, output_slot, "
            "error_slot, errors, cancelling_at, final_status, final_at, output_file_id, error_file_id, usage")


class Stage(enum.StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    RUNNING = "running"
    FINALIZED = "finalized"


@dataclass(frozen=True)
class OpenAIBatchRow:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, str] | None
    created_at: float
    expires_at: float
    stage: Stage
    output_slot: str
    error_slot: str
    errors: list[BatchError] | None
    cancelling_at: float | None
    final_status: BatchStatus | None
    final_at: float | None
    output_file_id: str | None
    error_file_id: str | None
    usage: BatchUsage | None

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> OpenAIBatchRow:
        (batch_id, endpoint, input_file_id, window, metadata, created_at, expires_at, stage, output_slot, error_slot,
         errors, cancelling_at, final_status, final_at, output_file_id, error_file_id, usage) = row
        return cls(batch_id, endpoint, input_file_id, window,
                   None if metadata is None else msgspec.json.decode(metadata, type=dict[str, str]),
                   created_at, expires_at, Stage(stage), output_slot, error_slot,
                   None if errors is None else msgspec.json.decode(errors, type=list[BatchError]),
                   cancelling_at, None if final_status is None else BatchStatus(final_status), final_at,
                   output_file_id, error_file_id, None if usage is None else msgspec.json.decode(usage, type=BatchUsage))


class OpenAIBatchStore:
    """The ``openai_batches`` table of ``requests``' file (``requests`` was opened with ``META_SCHEMA``)."""

    def __init__(self, requests: BatchStore) -> None:
        self.requests = requests

    def create(self, batch_id: str, endpoint: str, input_file_id: str, completion_window: str,
               metadata: dict[str, str] | None, now: float, ttl_seconds: float) -> OpenAIBatchRow:
        with self.requests.transaction() as conn:
            conn.execute(
                "INSERT INTO openai_batches (id, endpoint, input_file_id, completion_window, metadata, created_at, "
                "expires_at, stage, output_slot, error_slot) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (batch_id, endpoint, input_file_id, completion_window,
                 None if metadata is None else msgspec.json.encode(metadata), now, now + ttl_seconds,
                 Stage.VALIDATING.value, new_file_id(), new_file_id()))
            return self._get(conn, batch_id)  # type: ignore[return-value]  # inserted just above

    def get(self, batch_id: str) -> OpenAIBatchRow | None:
        with self.requests.transaction() as conn:
            return self._get(conn, batch_id)

    @staticmethod
    def _get(conn: sqlite3.Connection, batch_id: str) -> OpenAIBatchRow | None:
        row = conn.execute(f"SELECT {_COLUMNS} FROM openai_batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else OpenAIBatchRow.from_row(row)

    def list(self, limit: int, after: str | None) -> tuple[builtins.list[OpenAIBatchRow], bool] | None:
        """Newest first, the page after batch ``after``; (page, has_more), None for an unknown ``after``."""
        with self.requests.transaction() as conn:
            if after is None:
                rows = conn.execute(f"SELECT {_COLUMNS} FROM openai_batches ORDER BY seq DESC LIMIT ?",
                                    (limit + 1,)).fetchall()
            else:
                found = conn.execute("SELECT seq FROM openai_batches WHERE id = ?", (after,)).fetchone()
                if found is None:
                    return None
                rows = conn.execute(f"SELECT {_COLUMNS} FROM openai_batches WHERE seq < ? ORDER BY seq DESC "
                                    "LIMIT ?", (found[0], limit + 1)).fetchall()
        return [OpenAIBatchRow.from_row(row) for row in rows[:limit]], len(rows) > limit

    def with_stage(self, stage: Stage) -> builtins.list[str]:
        with self.requests.transaction() as conn:
            rows = conn.execute("SELECT id FROM openai_batches WHERE stage = ? ORDER BY seq",
                                (stage.value,)).fetchall()
        return [row[0] for row in rows]

    def set_running(self, batch_id: str) -> bool:
        """validating -> running; False if the batch was no longer validating (cancelled meanwhile)."""
        return self._move(batch_id, Stage.VALIDATING, "stage = ?", (Stage.RUNNING.value,))

    def set_failed(self, batch_id: str, errors: builtins.list[BatchError], now: float) -> bool:
        return self._move(batch_id, Stage.VALIDATING, "stage = ?, errors = ?, final_at = ?",
                          (Stage.FAILED.value, msgspec.json.encode(errors), now))

    def cancel_validating(self, batch_id: str, now: float) -> bool:
        """A batch cancelled before its requests existed ends cancelled at once, with no files."""
        return self._move(batch_id, Stage.VALIDATING,
                          "stage = ?, final_status = ?, cancelling_at = ?, final_at = ?",
                          (Stage.FINALIZED.value, BatchStatus.CANCELLED.value, now, now))

    def set_finalized(self, batch_id: str, final_status: BatchStatus, output_file_id: str | None,
                      error_file_id: str | None, usage: BatchUsage, now: float) -> bool:
        return self._move(batch_id, Stage.RUNNING, "stage = ?, final_status = ?, final_at = ?, output_file_id = ?, "
                          "error_file_id = ?, usage = ?", (Stage.FINALIZED.value, final_status.value, now,
                                                           output_file_id, error_file_id, msgspec.json.encode(usage)))

    def _move(self, batch_id: str, from_stage: Stage, assignments: str, args: tuple[Any, ...]) -> bool:
        with self.requests.transaction() as conn:
            return conn.execute(f"UPDATE openai_batches SET {assignments} WHERE id = ? AND stage = ?",
                                (*args, batch_id, from_stage.value)).rowcount == 1
