"""Is pid P still the process we started? A pid plus its start time says so.

The kernel recycles pids, so a pid recorded in a file (``state.json``, an IPC
directory's owner file) may name an unrelated process by the time someone
reads it. Field 22 of ``/proc/PID/stat`` (``starttime``, clock ticks since
boot) does not change for a process's life and differs for the next process
given the same pid, so ``(pid, start_time)`` names one process. Whoever
signals or deletes on the strength of a recorded pid checks ``same_process``
first (``common.processes.terminate`` takes it as ``alive``); a pid whose start
time cannot be read is not ours.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["process_start_time", "same_process"]


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after the ``(comm)`` field (which may hold spaces and parentheses)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None when it is gone or a zombie."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):  # fields[0] is field 3 (state): exited, not reaped
        return None
    return int(fields[19])  # field 22: starttime (fields after comm start at field 3)


def same_process(pid: int, start_time: int | None) -> bool:
    """True when ``pid`` runs and is the process that had ``start_time`` (None never matches)."""
    return start_time is not None and pid > 0 and process_start_time(pid) == start_time
