"""Streaming load against an orchestrator, each stream tied to the process that serves it (for failover tests).

    load = StreamLoad(url, model, concurrency=32)
    load.start()
    load.pause(); owners = load.owners(port, pids); os.kill(...); load.resume()
    ...
    load.stop()

Each of ``concurrency`` threads opens streams one after the other, each on a
fresh connection (so SO_REUSEPORT spreads them over the processes). Which
process serves a stream is read from the kernel: the server side of its TCP
connection (``/proc/net/tcp``: local port = the orchestrator's, remote port =
the stream's) is a socket inode that exactly one process holds as a file
descriptor (``/proc/<pid>/fd``).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

__all__ = ["StreamLoad", "Stream", "server_pids"]


@dataclass
class Stream:
    started: float
    client_port: int | None = None
    status: int | str | None = None
    events: list[str] = field(default_factory=list)
    ended: float | None = None
    server_pid: int | None = None
    """The process serving it at the last ``owners`` call (None: not in flight then)."""

    @property
    def complete(self) -> bool:
        return (self.status == 200 and self.events[-1:] == ["[DONE]"]
                and not any('"error"' in event for event in self.events))


def _socket_inodes(pid: int) -> set[int]:
    found = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                found.add(int(target[8:-1]))
    except OSError:
        pass
    return found


def server_pids(port: int, pids: list[int]) -> dict[int, int]:
    """client port -> the pid (of ``pids``) holding the server side of its connection to ``port``."""
    by_inode: dict[int, int] = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, inode = fields[1], fields[2], int(fields[9])
        if int(local.split(":")[1], 16) == port and inode:
            by_inode[inode] = int(remote.split(":")[1], 16)
    owners = {}
    for pid in pids:
        for inode in _socket_inodes(pid) & by_inode.keys():
            owners[by_inode[inode]] = pid
    return owners


class StreamLoad:
    def __init__(self, url: str, model: str, concurrency: int = 32, max_tokens: int = 120) -> None:
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.streams: list[Stream] = []
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._open = threading.Event()
        self._open.set()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(concurrency)]

    def start(self) -> None:
        self._running.set()
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        self._running.clear()
        self._open.set()
        for thread in self._threads:
            thread.join(timeout)

    def pause(self) -> None:
        """No new stream starts (until ``resume``)."""
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def in_flight(self) -> list[Stream]:
        with self._lock:
            return [s for s in self.streams if s.ended is None]

    def owners(self, port: int, pids: list[int], timeout: float = 15.0) -> None:
        """Tie every stream in flight to the process serving it now (paused: once each has its answer's
        head, when its client port is known; a busy machine may take seconds to the first byte)."""
        deadline = time.monotonic() + timeout
        while any(s.client_port is None for s in self.in_flight()) and time.monotonic() < deadline:
            time.sleep(0.02)
        found = server_pids(port, pids)
        for stream in self.in_flight():
            stream.server_pid = found.get(stream.client_port) if stream.client_port is not None else None

    def _loop(self) -> None:
        body = {"model": self.model, "prompt": "once upon a time", "max_tokens": self.max_tokens, "stream": True,
                "ignore_eos": True}
        while self._running.is_set():
            self._open.wait()
            if not self._running.is_set():
                return
            stream = Stream(started=time.monotonic())
            with self._lock:
                self.streams.append(stream)
            try:
                with httpx.Client(timeout=60) as client, \
                        client.stream("POST", f"{self.url}/v1/completions", json=body) as response:
                    stream.client_port = response.extensions["network_stream"].get_extra_info("client_addr")[1]
                    stream.status = response.status_code
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            stream.events.append(line[6:])
            except httpx.HTTPError as exc:
                stream.status = stream.status if stream.events else type(exc).__name__
                stream.events.append(f'{{"error": "{type(exc).__name__}"}}')
            stream.ended = time.monotonic()
