"""Which attached frontends the launcher left down (past their restart budget): a file in the IPC directory.

Any of a worker's K frontends may answer ``/health``, but only the launcher
knows which frontends it gave up on. It writes ``frontends-down.json`` in the
worker's private IPC directory whenever it leaves one down (atomically:
written aside, then renamed), and every frontend's ``/health`` reads it: a
worker with fewer frontends than configured still serves, so it answers 200
with ``status: degraded`` (routers keep it; operators see it).
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

__all__ = ["FrontendsDown", "write_frontends_down", "read_frontends_down"]


class FrontendsDown(msgspec.Struct, frozen=True):
    left_down: list[int]
    """Frontend ids the launcher no longer respawns."""
    num_frontends: int
    """The worker's configured frontends (K)."""


def write_frontends_down(path: Path, down: FrontendsDown) -> None:
    aside = path.with_suffix(".tmp")
    aside.write_bytes(msgspec.json.encode(down))
    os.replace(aside, path)


def read_frontends_down(path: Path) -> FrontendsDown | None:
    """None while every frontend is supervised (no file, or one that does not decode)."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=FrontendsDown)
    except (OSError, msgspec.DecodeError):
        return None
