"""OpenAIBatches: the OpenAI Files and Batches APIs' state, over the Message Batches' runner.

One directory holds it all: ``FileStore`` (``files.sqlite3`` + ``files/``)
and ``openai_batches.sqlite3``, a ``BatchStore`` (the requests, run by a
``BatchRunner`` exactly as Message Batches are: order, in-flight bound,
restart, cancel and expiry policies are ``api.batches.runner``'s) that
also holds the OpenAI fields (``OpenAIBatchStore``). The executor runs one
input line (``api.batches.openai_lines``); the orchestrator's runs it
through its disaggregated flow.

Lifecycle of a batch (``OpenAIBatchStore``'s stages, OpenAI's statuses):

- create: the batch is ``validating`` and the input file is read in the
  background: a file that is not there, empty, or over ``MAX_REQUESTS``
  lines fails the batch (``failed``, ``errors`` saying why); bad lines are
  settled at once as error lines. The requests then exist: ``in_progress``.
- the runner ends the batch (every request settled): ``finalizing`` while
  the output file (200 answers) and error file (the rest) are written, then
  ``completed``, or ``expired`` if the 24 h window cut requests, or
  ``cancelled``. A file with no line is not written (its id stays null).
- cancel: ``cancelling`` (running requests aborted, the rest not started),
  then ``cancelled`` with the partial output; cancelled and expired requests
  are error lines (``batch_cancelled``, ``batch_expired``).
- restart: a batch left ``validating`` is validated again, one whose
  requests ended but whose files were not written is finalized again.
"""

from __future__ import annotations

import asyncio
import builtins  # the method OpenAIBatches.list shadows the builtin in annotations after it
import logging
import secrets
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import msgspec

from api.batches.executor import BatchExecutor
from api.batches.files import FileRecord, FileStore
from api.batches.openai_lines import UsageSum, error_line, line_error_outcome, read_line
from api.batches.openai_schemas import (
    COMPLETION_WINDOWS,
    BatchError,
    BatchErrors,
    BatchRequestCounts,
    BatchStatus,
    CreateBatchBody,
    FilePurpose,
    OpenAIBatch,
)
from api.batches.openai_store import META_SCHEMA, OpenAIBatchRow, OpenAIBatchStore, Stage
from api.batches.runner import DEFAULT_MAX_IN_FLIGHT, BatchRunner
from api.batches.store import DEFAULT_TTL_SECONDS, BatchRecord, BatchStore
from api.errors import InvalidRequestError, NotFoundError

__all__ = ["OpenAIBatches", "OPENAI_BATCHES_FILE", "MAX_REQUESTS", "RESULT_PAGE"]

logger = logging.getLogger(__name__)

OPENAI_BATCHES_FILE = "openai_batches.sqlite3"
MAX_REQUESTS = 50_000  # OpenAI's limit per batch
RESULT_PAGE = 1000
_UNSETTLED_CODES = {"canceled": ("batch_cancelled", "the batch was cancelled before this request finished"),
                    "expired": ("batch_expired", "the batch's completion window ended before this request ran")}


class OpenAIBatches:
    """Owns its stores and runner: ``await start()`` ... ``await close()``."""

    def __init__(self, directory: str | Path, executor: BatchExecutor, *,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, ttl_seconds: float = DEFAULT_TTL_SECONDS,
                 clock: Callable[[], float] = time.time) -> None:
        directory = Path(directory)
        self.files = FileStore(directory)
        try:
            requests = BatchStore(directory / OPENAI_BATCHES_FILE, id_prefix="batch_", extra_schema=META_SCHEMA)
        except BaseException:
            self.files.close()
            raise
        self.meta = OpenAIBatchStore(requests)
        self.runner = BatchRunner(requests, executor, max_in_flight=max_in_flight, ttl_seconds=ttl_seconds,
                                  clock=clock, on_end=self._ended)
        self.ttl_seconds = ttl_seconds
        self.clock = clock
        self._background: set[asyncio.Task[Any]] = set()
        self._finalizing = threading.Lock()

    async def start(self) -> None:
        await self.runner.start()
        for batch_id in await asyncio.to_thread(self.meta.with_stage, Stage.VALIDATING):
            self._spawn(self._validate(batch_id))
        for batch_id in await asyncio.to_thread(self.meta.with_stage, Stage.RUNNING):
            record = await asyncio.to_thread(self.runner.store.get, batch_id)
            if record is not None and record.processing_status == "ended":
                self._spawn(self._finalize(batch_id))

    async def close(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        # A cancelled task's thread may still be writing a batch's files: let it finish first.
        await asyncio.to_thread(self._finalizing.acquire)
        try:
            await self.runner.close()  # closes the requests' store
            await asyncio.to_thread(self.files.close)
        finally:
            self._finalizing.release()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:  # redone at the next start
            logger.error("validating or finalizing a batch failed", exc_info=task.exception())

    # -- what the routes call ------------------------------------------------------------------------

    async def create(self, body: CreateBatchBody) -> OpenAIBatch:
        if body.completion_window not in COMPLETION_WINDOWS:
            raise InvalidRequestError(f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}, got "
                                      f"{body.completion_window!r}", param="completion_window")
        source = await asyncio.to_thread(self.files.get, body.input_file_id)
        if source is None:
            raise NotFoundError(f"No such File object: {body.input_file_id}", param="input_file_id")
        if source.purpose != FilePurpose.BATCH.value:
            raise InvalidRequestError(f"file {source.id} has purpose {source.purpose!r}; a batch's input file must "
                                      "be uploaded with purpose 'batch'", param="input_file_id")
        batch_id = "batch_" + secrets.token_hex(12)
        row = await asyncio.to_thread(self.meta.create, batch_id, body.endpoint.value, source.id,
                                      body.completion_window, body.metadata, self.clock(), self.ttl_seconds)
        self._spawn(self._validate(batch_id))
        return self._view(row, None)

    async def get(self, batch_id: str) -> OpenAIBatch:
        row = await asyncio.to_thread(self.meta.get, batch_id)
        if row is None:
            raise NotFoundError(f"No such Batch object: {batch_id}", param="batch_id")
        return self._view(row, await asyncio.to_thread(self.runner.store.get, batch_id))

    async def list(self, limit: int, after: str | None) -> tuple[list[OpenAIBatch], bool]:
        page = await asyncio.to_thread(self.meta.list, limit, after)
        if page is None:
            raise InvalidRequestError(f"after: no batch {after!r}", param="after")
        rows, has_more = page
        return [self._view(row, await asyncio.to_thread(self.runner.store.get, row.id)) for row in rows], has_more

    async def cancel(self, batch_id: str) -> OpenAIBatch:
        row = await asyncio.to_thread(self.meta.get, batch_id)
        if row is None:
            raise NotFoundError(f"No such Batch object: {batch_id}", param="batch_id")
        if row.stage is Stage.VALIDATING and await asyncio.to_thread(self.meta.cancel_validating, batch_id,
                                                                     self.clock()):
            return await self.get(batch_id)
        if row.stage in (Stage.FAILED, Stage.FINALIZED):
            status = BatchStatus.FAILED if row.stage is Stage.FAILED else row.final_status
            raise InvalidRequestError(f"batch {batch_id} is {status.value if status else row.stage.value}; only a "
                                      "batch still validating or in progress can be cancelled")
        await self.runner.cancel(batch_id)  # the runner ends it: _finalize writes its files
        return await self.get(batch_id)

    # -- validating ----------------------------------------------------------------------------------

    async def _validate(self, batch_id: str) -> None:
        row = await asyncio.to_thread(self.meta.get, batch_id)
        if row is None or row.stage is not Stage.VALIDATING:
            return
        if await asyncio.to_thread(self.runner.store.get, batch_id) is None:  # not created before a restart
            try:
                items, settled = await asyncio.to_thread(self._read_input, row)
            except _InputRejected as exc:
                await asyncio.to_thread(self.meta.set_failed, batch_id, [exc.error], self.clock())
                return
            await self.runner.create(items, settled, batch_id=batch_id)
        if not await asyncio.to_thread(self.meta.set_running, batch_id):  # cancelled while validating
            await self.runner.cancel(batch_id)
            return
        record = await asyncio.to_thread(self.runner.store.get, batch_id)
        if record is not None and record.processing_status == "ended":  # ended before it was running
            await self._finalize(batch_id)

    def _read_input(self, row: OpenAIBatchRow) -> tuple[builtins.list[tuple[str, bytes]], dict[int, tuple[str, bytes]]]:
        """The input file's requests as (custom_id, line) items, and its bad lines settled as errors."""
        source = self.files.get(row.input_file_id)
        if source is None:
            raise _InputRejected(BatchError("invalid_file", f"the input file {row.input_file_id} was deleted",
                                            param="input_file_id"))
        lines = [line for line in self.files.read(source.id).splitlines() if line.strip()]
        if not lines:
            raise _InputRejected(BatchError("empty_file", f"the input file {source.id} holds no request",
                                            param="input_file_id"))
        if len(lines) > MAX_REQUESTS:
            raise _InputRejected(BatchError("too_many_requests", f"a batch holds at most {MAX_REQUESTS} requests; "
                                            f"the input file has {len(lines)} lines", param="input_file_id"))
        items: builtins.list[tuple[str, bytes]] = []
        settled: dict[int, tuple[str, bytes]] = {}
        seen: set[str] = set()
        for idx, raw in enumerate(lines):
            try:
                custom_id = read_line(raw, row.endpoint).custom_id
                if custom_id in seen:
                    raise InvalidRequestError(f"custom_id {custom_id!r} is not unique in the batch", param="custom_id")
            except InvalidRequestError as exc:
                named = _custom_id_of(raw)
                settled[idx] = line_error_outcome(named, idx + 1, exc)
                items.append((named or "", raw))
                continue
            seen.add(custom_id)
            items.append((custom_id, raw))
        return items, settled

    # -- finalizing ----------------------------------------------------------------------------------

    async def _ended(self, batch_id: str) -> None:
        """The runner's end hook: the files are written beside it, not holding its dispatcher."""
        self._spawn(self._finalize(batch_id))

    async def _finalize(self, batch_id: str) -> None:
        await asyncio.to_thread(self._write_files, batch_id)

    def _write_files(self, batch_id: str) -> None:
        with self._finalizing:  # once: the runner's end hook and _validate may both ask
            self._write_files_once(batch_id)

    def _write_files_once(self, batch_id: str) -> None:
        row = self.meta.get(batch_id)
        record = self.runner.store.get(batch_id)
        if row is None or row.stage is not Stage.RUNNING or record is None:
            return  # not an OpenAI batch's, or finalized already
        now = self.clock()
        usage = UsageSum()
        output = self._write(row.output_slot, f"{batch_id}_output.jsonl",
                             usage.counted(self._lines(batch_id, errors=False)), now)
        errors = self._write(row.error_slot, f"{batch_id}_error.jsonl", self._lines(batch_id, errors=True), now)
        if record.cancel_initiated_at is not None:
            status = BatchStatus.CANCELLED
        elif record.request_counts.expired:
            status = BatchStatus.EXPIRED
        else:
            status = BatchStatus.COMPLETED
        self.meta.set_finalized(batch_id, status, output.id if output else None, errors.id if errors else None,
                                usage.total(), now)

    def _write(self, file_id: str, filename: str, lines: Iterator[bytes], now: float) -> FileRecord | None:
        first = next(lines, None)
        if first is None:
            return None

        def chunks() -> Iterator[bytes]:
            yield first
            yield from lines

        return self.files.add(filename, FilePurpose.BATCH_OUTPUT.value, chunks(), now, file_id=file_id)

    def _lines(self, batch_id: str, errors: bool) -> Iterator[bytes]:
        """The output file's lines (``errors`` False) or the error file's, in input order."""
        after: int | None = None
        while rows := self.runner.store.results(batch_id, after, RESULT_PAGE):
            for result in rows:
                if (result.state == "succeeded") is errors:
                    continue
                if result.state in _UNSETTLED_CODES:
                    code, message = _UNSETTLED_CODES[result.state]
                    yield error_line(result.custom_id or None, code, message) + b"\n"
                else:
                    yield result.result + b"\n"
            after = rows[-1].idx

    # -- the Batch object ----------------------------------------------------------------------------

    def _view(self, row: OpenAIBatchRow, record: BatchRecord | None) -> OpenAIBatch:
        """The Batch object: OpenAI's status and times from the stage and the requests' record."""
        status = {Stage.VALIDATING: BatchStatus.VALIDATING, Stage.FAILED: BatchStatus.FAILED,
                  Stage.FINALIZED: row.final_status}.get(row.stage)
        counts = BatchRequestCounts(0, 0, 0)
        in_progress_at = finalizing_at = None
        cancelling_at = row.cancelling_at  # cancelled while validating: no record
        if record is not None:
            c = record.request_counts
            counts = BatchRequestCounts(c.processing + c.succeeded + c.errored + c.canceled + c.expired,
                                        c.succeeded, c.errored)
            in_progress_at = record.created_at
            cancelling_at = record.cancel_initiated_at
            if record.cancel_initiated_at is None:
                finalizing_at = record.ended_at
            if row.stage is Stage.RUNNING:
                status = (BatchStatus.CANCELLING if record.cancel_initiated_at is not None
                          else BatchStatus.FINALIZING if record.processing_status == "ended"
                          else BatchStatus.IN_PROGRESS)
        assert status is not None  # every stage has one
        final_at = {status: row.final_at}
        return OpenAIBatch(
            id=row.id, endpoint=row.endpoint, input_file_id=row.input_file_id,
            completion_window=row.completion_window, status=status, created_at=int(row.created_at),
            expires_at=int(row.expires_at), request_counts=counts, metadata=row.metadata,
            errors=BatchErrors(row.errors) if row.errors else None,
            output_file_id=row.output_file_id, error_file_id=row.error_file_id,
            in_progress_at=_seconds(in_progress_at), finalizing_at=_seconds(finalizing_at),
            cancelling_at=_seconds(cancelling_at), failed_at=_seconds(final_at.get(BatchStatus.FAILED)),
            completed_at=_seconds(final_at.get(BatchStatus.COMPLETED)),
            expired_at=_seconds(final_at.get(BatchStatus.EXPIRED)),
            cancelled_at=_seconds(final_at.get(BatchStatus.CANCELLED)), usage=row.usage)


def _seconds(moment: float | None) -> int | None:
    return None if moment is None else int(moment)


class _InputRejected(Exception):
    def __init__(self, error: BatchError) -> None:
        super().__init__(error.message)
        self.error = error


def _custom_id_of(raw: bytes) -> str | None:
    """A bad line's custom_id when it has a readable one (its error line names it)."""
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    custom_id = value.get("custom_id") if isinstance(value, dict) else None
    return custom_id if isinstance(custom_id, str) else None
