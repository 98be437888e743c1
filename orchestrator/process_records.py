"""Which processes an orchestrator runs, recorded in its state directory, so nothing outlives ``down``.

The keeper (``disagg orchestrator`` itself, ``orchestrator.keeper``) writes
``keeper.json`` (its pid, start time and the port) and, as it spawns each
serving process, ``processes/<index>.json`` (pid and start time). They serve
three readers:

- a keeper started again (``disagg up`` restarts a dead one) adopts the
  serving processes still running instead of starting a second set;
- a serving process checks that some keeper still runs (``keeper_alive``),
  and exits once none has for ``ORPHAN_SECONDS``: a deployment whose keeper
  is gone for good does not serve for ever with nobody to respawn it;
- ``disagg down`` and the supervisor stop every recorded process still
  running (``sweep``), also one whose parent died before it.

A record is ``(pid, start_time)`` (``common.process_identity``): a pid that
was recycled since is never signalled. Written atomically (temporary file,
then rename); a missing or torn file reads as no record.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec

from common.process_identity import process_start_time, same_process
from common.processes import terminate

__all__ = ["ProcessRecord", "KeeperRecord", "write_record", "read_records", "forget_records", "write_keeper",
           "read_keeper", "keeper_alive", "sweep", "ORPHAN_SECONDS", "KEEPER_FILE"]

PROCESSES_DIR = "processes"
KEEPER_FILE = "keeper.json"
ORPHAN_SECONDS = 30.0
"""How long a serving process goes on without a keeper (a restarted one adopts it well within this)."""


class ProcessRecord(msgspec.Struct, frozen=True):
    pid: int
    start_time: int | None

    def running(self) -> bool:
        return same_process(self.pid, self.start_time)


class KeeperRecord(msgspec.Struct, frozen=True):
    pid: int
    start_time: int | None
    port: int
    """The port the serving processes share: an adopting keeper keeps it (a config's port may be 0)."""

    def running(self) -> bool:
        return same_process(self.pid, self.start_time)


def _write(path: Path, payload: msgspec.Struct) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.json.encode(payload))
    tmp.replace(path)


def write_record(state_dir: str | Path, index: int, pid: int) -> ProcessRecord:
    record = ProcessRecord(pid, process_start_time(pid))
    _write(Path(state_dir) / PROCESSES_DIR / f"{index}.json", record)
    return record


def read_records(state_dir: str | Path) -> dict[int, ProcessRecord]:
    """Every recorded serving process by index (running or not)."""
    found = {}
    for path in (Path(state_dir) / PROCESSES_DIR).glob("*.json"):
        try:
            found[int(path.stem)] = msgspec.json.decode(path.read_bytes(), type=ProcessRecord)
        except (OSError, ValueError, msgspec.DecodeError):
            continue
    return found


def forget_records(state_dir: str | Path) -> None:
    """Every serving process has stopped: nothing to adopt or sweep."""
    shutil.rmtree(Path(state_dir) / PROCESSES_DIR, ignore_errors=True)


def write_keeper(state_dir: str | Path, port: int) -> None:
    _write(Path(state_dir) / KEEPER_FILE, KeeperRecord(os.getpid(), process_start_time(os.getpid()), port))


def read_keeper(state_dir: str | Path) -> KeeperRecord | None:
    try:
        return msgspec.json.decode((Path(state_dir) / KEEPER_FILE).read_bytes(), type=KeeperRecord)
    except (OSError, msgspec.DecodeError):
        return None


def keeper_alive(state_dir: str | Path) -> bool:
    keeper = read_keeper(state_dir)
    return keeper is not None and keeper.running()


def sweep(state_dir: str | Path, timeout: float) -> list[int]:
    """SIGTERM the recorded keeper and serving processes still running, SIGKILL them after
    ``timeout``; the pids found running."""
    records: list[KeeperRecord | ProcessRecord] = list(read_records(state_dir).values())
    keeper = read_keeper(state_dir)
    if keeper is not None:
        records.append(keeper)
    running = {r.pid: r for r in records if r.running()}
    terminate(list(running), timeout, alive=lambda pid: running[pid].running())
    return sorted(running)
