"""Who owns a worker's IPC directory, and sweeping the ones whose owners are all gone.

Each process of a worker removes the directory when it leaves last, but a
worker whose processes are all SIGKILLed at once cannot: its
``<tmp>/disagg-*`` directory (sockets, Prometheus files, the engine spec)
stays behind. So the launcher writes ``owners.json`` into the directory, the
``(pid, start time)`` of itself and then of its engine (``process_identity``),
and every new launcher (and ``disagg down``) sweeps the directories whose
recorded owners are all gone. A directory is never deleted while one owner
still runs, nor when it has no owner file (another launcher between its
``mkdtemp`` and its first write, or a directory this code did not make), nor
when another user owns it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from common.process_identity import process_start_time, same_process

__all__ = ["OWNERS_FILE", "IPC_DIR_PREFIX", "record_owner", "sweep_stale_ipc_dirs"]

log = logging.getLogger(__name__)

OWNERS_FILE = "owners.json"
IPC_DIR_PREFIX = "disagg-"


def record_owner(ipc_dir: Path, pid: int) -> None:
    """Add ``pid`` (with its start time) to the directory's owners; written atomically."""
    path = ipc_dir / OWNERS_FILE
    owners = _read_owners(path) or []
    owners.append([pid, process_start_time(pid)])
    tmp = ipc_dir / f"{OWNERS_FILE}.tmp"
    tmp.write_text(json.dumps(owners))
    tmp.replace(path)


# [[pid, start time or null], ...] as record_owner wrote it; JSON from disk, so the items stay unchecked
# (Any) and the sweep converts them.
def _read_owners(path: Path) -> list[list[Any]] | None:
    try:
        owners = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return owners if isinstance(owners, list) else None


def _bases() -> list[Path]:
    # make_ipc_dir falls back to /tmp when TMPDIR is too long for socket paths: sweep both.
    return sorted({Path(tempfile.gettempdir()), Path("/tmp")})


def sweep_stale_ipc_dirs(prefix: str = IPC_DIR_PREFIX) -> list[Path]:
    """Remove this user's IPC directories whose recorded owners have all exited; the removed ones."""
    removed = []
    for base in _bases():
        try:
            candidates = [p for p in base.iterdir() if p.name.startswith(prefix)]
        except OSError:
            continue
        for path in candidates:
            try:
                if not path.is_dir() or path.is_symlink() or path.stat().st_uid != os.getuid():
                    continue
            except OSError:
                continue
            owners = _read_owners(path / OWNERS_FILE)
            if not owners or any(same_process(int(pid), start) for pid, start in owners):
                continue
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed %s: its worker's processes %s are all gone", path, [pid for pid, _ in owners])
            removed.append(path)
    return removed
