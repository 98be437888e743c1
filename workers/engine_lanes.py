"""The engine's lanes to its frontends and the heartbeat on them (``workers.engine_proc``).

A lane is a PUSH socket per frontend; the heartbeat thread sends an empty ``OutputBatch`` on its
own sockets every ``HEARTBEAT_SECONDS`` even during a long step (slow is not dead: frontends count
silent heartbeats), and stops an engine whose launcher is gone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import zmq

from workers.ipc import HEARTBEAT_SECONDS, LANE_SNDHWM, FrameCodec, IpcPaths, configure_engine_push, send_nowait
from workers.protocol import OutputBatch

__all__ = ["connect_lane", "Heartbeat"]


def connect_lane(ctx: zmq.Context, paths: IpcPaths, frontend_id: int, sndhwm: int = LANE_SNDHWM) -> zmq.Socket:
    # Not zmq.IMMEDIATE: a lane connected before its frontend binds queues the
    # Hello reply until the frontend is there, instead of dropping it.
    sock = ctx.socket(zmq.PUSH)
    configure_engine_push(sock, sndhwm)
    sock.connect(paths.lane(frontend_id))
    return sock


class Heartbeat:
    """Sends an empty OutputBatch on every lane each HEARTBEAT_SECONDS, from its own
    thread and sockets (zmq sockets are not thread-safe), even during a long step.
    It also watches the launcher: an orphaned engine stops instead of holding the GPU."""

    def __init__(self, ctx: zmq.Context, paths: IpcPaths, key: bytes, num_lanes: int,
                 launcher_pid: int | None, on_launcher_gone: Callable[[], None]) -> None:
        self._ctx, self._paths, self._num_lanes = ctx, paths, num_lanes
        self._launcher_pid, self._on_launcher_gone = launcher_pid, on_launcher_gone
        self._codec: FrameCodec = FrameCodec(key, OutputBatch, "engine heartbeat")
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        lanes = [connect_lane(self._ctx, self._paths, i) for i in range(self._num_lanes)]
        try:
            while not self._stopped.wait(HEARTBEAT_SECONDS):
                if self._launcher_pid is not None and os.getppid() != self._launcher_pid:
                    self._on_launcher_gone()
                for lane in lanes:
                    send_nowait(lane, self._codec, OutputBatch([], time.time()))
        finally:
            for lane in lanes:
                lane.close(linger=0)
