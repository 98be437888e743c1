"""The HTTP server plumbing both servers run on (a worker's frontends and the orchestrator's processes).

Every process of a server listens on the same port through its own socket
bound with SO_REUSEPORT (the kernel spreads connections over them). The
caller owns the signals: uvicorn's own handlers are replaced, because they
re-raise the signal after serving, which would kill a worker's launcher before it
stops the engine and removes the IPC directory (``frontends.worker_server``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import uvicorn

__all__ = ["make_listen_socket", "make_unix_listen_socket", "QuietServer", "run_event_loop", "settle_gc"]

T = TypeVar("T")

GC_GEN0_THRESHOLD = 20_000  # allocations between young collections (Python's default: 700)


def settle_gc() -> None:
    """The collector set for serving, once the app is built: what exists now (tokenizer,
    templates, routes) is frozen out of every later collection, and young collections are
    rarer; a request's garbage is short-lived and mostly freed by reference counting.
    As the engine process does at ready (``workers.engine_proc``)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 10, 10)


def make_unix_listen_socket(path: str, backlog: int = 256) -> socket.socket:
    """The launcher's admin socket (inside the worker's private 0700 directory)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a stale file from a crashed launcher of the same directory
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(backlog)
    sock.set_inheritable(False)
    return sock


def make_listen_socket(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """A listening TCP socket that the worker's other frontends can share (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(False)
    return sock


class QuietServer(uvicorn.Server):
    """uvicorn without its signal handling (see the module docstring)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop when it is installed, else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
