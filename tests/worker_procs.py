"""Find the processes of a running worker (tests only): by parent pid and attach slot."""

from __future__ import annotations

import os
import time
from pathlib import Path

from common.processes import pid_alive

__all__ = ["children_of", "frontend_slots", "engine_pid", "wait_until", "group_pids_alive"]


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def children_of(parent: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and int(stat[1]) == parent and stat[0] not in ("Z", "X"):
                pids.append(int(entry))
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def frontend_slots(launcher: int) -> dict[int, int]:
    """Attached frontend id -> pid, from each child's DISAGG_ATTACH_FILE (attach-<id>.json)."""
    slots = {}
    for pid in children_of(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"DISAGG_ATTACH_FILE="):
                slots[int(item.decode().rsplit("attach-", 1)[1].split(".")[0])] = pid
    return slots


def engine_pid(launcher: int) -> int:
    (pid,) = [p for p in children_of(launcher) if "workers.engine_proc" in _cmdline(p)]
    return pid


def group_pids_alive(pids: list[int]) -> list[int]:
    return [p for p in pids if pid_alive(p)]


def wait_until(predicate, timeout: float, interval: float = 0.05) -> float:
    """Seconds it took ``predicate()`` to become true; AssertionError after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout:g} s")
        time.sleep(interval)
    return time.monotonic() - start
