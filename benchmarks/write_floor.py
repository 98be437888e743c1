"""The kernel's floor under an SSE event: the CPU of one paced loopback write, and nothing else.

A writer process (uvloop, as a frontend runs) accepts ``connections`` TCP
connections from a reader process and, every ``interval`` seconds (the paced
decode step of ``benchmarks/hot_paths.py``), writes one frame of
``frame_bytes`` to each through its asyncio transport: the writes that a
streamed answer makes, at the same pacing, to a reader that is woken by each,
with none of the frontend's Python. Its CPU seconds (``getrusage``, the
writer's own) per write are the floor under the frontend's CPU per SSE event;
``hot_paths.py`` runs this in the same invocation and prints the difference.

    python benchmarks/write_floor.py [--connections 64] [--interval 0.01] [--frame-bytes 200]
        [--warmup 1] [--duration 4]      # prints {"writes": ..., "cpu_s": ..., "us_per_write": ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

HOST = "127.0.0.1"


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Discard(asyncio.Protocol):
    def data_received(self, data: bytes) -> None:
        pass


async def _read(port: int, connections: int) -> None:
    """The reader: ``connections`` connections that read until the writer closes them."""
    loop = asyncio.get_running_loop()
    transports = [(await loop.create_connection(_Discard, HOST, port))[0] for _ in range(connections)]
    while not all(t.is_closing() for t in transports):
        await asyncio.sleep(0.1)


async def _write(args: argparse.Namespace) -> dict:
    loop = asyncio.get_running_loop()
    accepted: list[asyncio.Transport] = []

    class Accept(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted.append(transport)  # type: ignore[arg-type]  # a TCP server's: a Transport

        def connection_lost(self, exc: Exception | None) -> None:
            pass

    sock = socket.socket()
    sock.bind((HOST, 0))
    server = await loop.create_server(Accept, sock=sock)
    reader = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--role", "reader",
                               "--port", str(sock.getsockname()[1]), "--connections", str(args.connections)])
    try:
        while len(accepted) < args.connections:
            if reader.poll() is not None:
                raise RuntimeError(f"the reader exited ({reader.returncode})")
            await asyncio.sleep(0.01)
        frame = b"x" * args.frame_bytes
        writes, window = 0, None
        started = time.monotonic()
        next_step = started
        while True:
            now = time.monotonic()
            if window is None and now >= started + args.warmup:
                window = (now, _cpu_s(), writes)
            if window is not None and now >= window[0] + args.duration:
                break
            for transport in accepted:  # a step's outputs: one write per stream
                transport.write(frame)
            writes += len(accepted)
            next_step += args.interval
            await asyncio.sleep(max(0.0, next_step - time.monotonic()))
        assert window is not None
        cpu, num_writes = _cpu_s() - window[1], writes - window[2]
        return {"writes": num_writes, "cpu_s": round(cpu, 4), "us_per_write": round(cpu / num_writes * 1e6, 3),
                "connections": args.connections, "interval_s": args.interval, "frame_bytes": args.frame_bytes}
    finally:
        for transport in accepted:
            transport.close()
        server.close()
        try:
            reader.wait(timeout=10)
        except subprocess.TimeoutExpired:
            reader.kill()


def measure_write_floor(connections: int = 64, interval: float = 0.01, frame_bytes: int = 200,
                        warmup: float = 1.0, duration: float = 4.0) -> dict:
    """This script run in a process of its own (its CPU apart from the caller's)."""
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--connections", str(connections),
                          "--interval", str(interval), "--frame-bytes", str(frame_bytes), "--warmup", str(warmup),
                          "--duration", str(duration)], check=True, capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=("writer", "reader"), default="writer")
    parser.add_argument("--port", type=int, default=0, help="the writer's (reader role)")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--interval", type=float, default=0.01)
    parser.add_argument("--frame-bytes", type=int, default=200)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=4.0)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from api.server import run_event_loop  # uvloop, as a frontend runs

    if args.role == "reader":
        run_event_loop(_read(args.port, args.connections))
        return 0
    print(json.dumps(run_event_loop(_write(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
