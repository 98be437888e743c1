"""The attach info: how a re-executed frontend finds its worker.

The launcher writes one file of mode 0600 per attached frontend inside the
worker's private IPC directory and names it in ``DISAGG_ATTACH_FILE``; the
key never appears on a command line or in an environment variable. The
launcher deletes the directory (and so every attach file) at exit, on every
path. Torch-free: frontends read this.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from workers.ipc import ENGINE_WEDGED_SECONDS, IpcPaths, write_private_file
from workers.protocol import EngineInfo

__all__ = ["ATTACH_FILE_ENV", "AttachInfo", "write_attach_file", "read_attach_file", "attach_file_from_env"]

ATTACH_FILE_ENV = "DISAGG_ATTACH_FILE"


class AttachInfo(msgspec.Struct, frozen=True):
    ipc_dir: str
    key_hex: str
    frontend_id: int
    num_frontends: int
    launcher_pid: int
    engine_pid: int
    engine: EngineInfo
    host: str
    port: int
    generation: int = 0  # respawns of this frontend slot so far (0: the first process)
    engine_wedged_seconds: float = ENGINE_WEDGED_SECONDS  # silence after which the engine is dead, not slow

    @property
    def key(self) -> bytes:
        return bytes.fromhex(self.key_hex)

    @property
    def paths(self) -> IpcPaths:
        return IpcPaths(Path(self.ipc_dir))


def write_attach_file(info: AttachInfo) -> Path:
    path = info.paths.attach_file(info.frontend_id)
    write_private_file(path, msgspec.json.encode(info))
    return path


def read_attach_file(path: str | Path) -> AttachInfo:
    return msgspec.json.decode(Path(path).read_bytes(), type=AttachInfo)


def attach_file_from_env() -> str | None:
    """The attach file named in the environment, or None in a launcher."""
    return os.environ.get(ATTACH_FILE_ENV) or None
