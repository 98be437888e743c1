"""A lean HTTP/1.1 load generator: keep-alive connections, a closed loop per connection.

Run in its own process by ``benchmarks/frontend_scaling.py`` (so the server's
CPU and the client's are apart), one run per invocation:

    python benchmarks/http_loadgen.py '<LoadSpec as JSON>'   # prints a LoadResult as JSON

Each of ``concurrency`` connections sends the same request again as soon as
the previous answer is complete. The client is an ``asyncio.Protocol`` on
uvloop that only scans bytes (no HTTP parser, no JSON): it finds the end of
the headers, then the end of the body (``Content-Length``, or the chunked
terminator ``0\\r\\n\\r\\n``), and for streamed chat completions the first
content delta (TTFT). It must not be the bottleneck: it reports its own CPU.

Window: after ``warmup_s`` the sampler records the CPU times of the server
processes (``/proc/<pid>/stat``) and its own (``getrusage``); after
``duration_s`` more it records them again and the connections stop sending.
Requests that completed between the two samples count; TTFT percentiles are
over the requests that started inside the window.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import subprocess
import sys
import time

import msgspec

__all__ = ["LoadSpec", "LoadResult", "run_load", "cpu_seconds"]

_CONTENT_MARK = b'"delta":{"content":'  # a chat chunk with text (the role chunk has "role" first)
_HEADER_END = b"\r\n\r\n"
_CHUNKED_END = b"0\r\n\r\n"
_CLK_TCK = os.sysconf("SC_CLK_TCK")


class LoadSpec(msgspec.Struct, frozen=True):
    host: str
    port: int
    request: str
    """The whole HTTP/1.1 request (latin-1 text), sent as is on every round."""
    concurrency: int
    warmup_s: float
    duration_s: float
    max_requests: int
    """Bound on requests sent in all (warm-up included)."""
    streaming: bool
    """True: TTFT is the time to the first content delta; False: to the end of the response."""
    server_pids: dict[str, list[int]] = {}
    """Role -> pids whose CPU seconds are sampled at the window's edges."""
    drain_timeout_s: float = 10.0


class LoadResult(msgspec.Struct):
    window_s: float
    requests: int
    errors: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    latency_p50_s: float | None
    content_chunks_per_request: float | None
    server_cpu_s: dict[str, list[float]]
    """Role -> CPU seconds used inside the window, per pid."""
    loadgen_cpu_s: float
    connections_failed: int
    latency_p99_s: float | None = None


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of ``pid`` (0.0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # fields 14 and 15 of proc(5), after "pid (comm)"


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Connection(asyncio.Protocol):
    """One keep-alive connection; ``round()`` sends the request and awaits the whole answer."""

    def __init__(self, streaming: bool) -> None:
        self.streaming = streaming
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future | None = None
        self.body_start = -1  # index in buffer after the headers; -1 until they arrived
        self.content_length: int | None = None
        self.first_content_at: float | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(False)

    def round(self, request: bytes) -> asyncio.Future:
        self.buffer.clear()
        self.body_start, self.content_length, self.first_content_at = -1, None, None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        scan_from = max(0, len(self.buffer) - len(_CONTENT_MARK))
        self.buffer += data
        buffer = self.buffer
        if self.body_start < 0 and not self._parse_headers():
            return
        if self.streaming and self.first_content_at is None and buffer.find(_CONTENT_MARK, scan_from) >= 0:
            self.first_content_at = time.perf_counter()
        if self.content_length is not None:
            done = len(buffer) - self.body_start >= self.content_length
        else:
            done = buffer.endswith(_CHUNKED_END) and (
                len(buffer) - self.body_start == len(_CHUNKED_END) or buffer.endswith(b"\r\n" + _CHUNKED_END))
        if done and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(buffer.startswith(b"HTTP/1.1 200"))

    def _parse_headers(self) -> bool:
        end = self.buffer.find(_HEADER_END)
        if end < 0:
            return False
        self.body_start = end + len(_HEADER_END)
        headers = bytes(self.buffer[:end]).lower()
        at = headers.find(b"\r\ncontent-length:")
        if at >= 0:
            line_end = headers.find(b"\r\n", at + 2)
            self.content_length = int(headers[at + 17 : line_end if line_end >= 0 else None])
        return True


class _Run:
    """Shared state of one load run: the window and what completed in it."""

    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        self.request = spec.request.encode("latin-1")
        self.window: tuple[float, float] | None = None  # perf_counter times of the two samples
        self.stop_sending = False
        self.sent = 0
        self.records: list[tuple[float, float, float, bool, int]] = []  # (start, ttft, end, ok, content chunks)
        self.connections_failed = 0


async def _connection_loop(run: _Run) -> None:
    loop = asyncio.get_running_loop()
    spec = run.spec
    conn: _Connection | None = None
    while not run.stop_sending and run.sent < spec.max_requests:
        if conn is None or conn.closed:
            try:
                _, conn = await loop.create_connection(lambda: _Connection(spec.streaming), spec.host, spec.port)
            except OSError:
                run.connections_failed += 1
                await asyncio.sleep(0.05)
                continue
        run.sent += 1
        start = time.perf_counter()
        ok = await conn.round(run.request)
        end = time.perf_counter()
        first = conn.first_content_at if spec.streaming else end
        ok = ok and first is not None
        chunks = conn.buffer.count(_CONTENT_MARK) if spec.streaming else 0
        run.records.append((start, (first or end) - start, end, ok, chunks))
    if conn is not None and conn.transport is not None:
        conn.transport.close()


def _sample(pids: dict[str, list[int]]) -> tuple[float, dict[str, list[float]], float]:
    return time.perf_counter(), {role: [cpu_seconds(p) for p in ps] for role, ps in pids.items()}, _own_cpu()


async def _sampler(run: _Run) -> tuple[dict[str, list[float]], float]:
    spec = run.spec
    await asyncio.sleep(spec.warmup_s)
    t0, cpu0, own0 = _sample(spec.server_pids)
    await asyncio.sleep(spec.duration_s)
    t1, cpu1, own1 = _sample(spec.server_pids)
    run.window = (t0, t1)
    run.stop_sending = True
    server = {role: [b - a for a, b in zip(cpu0[role], cpu1[role])] for role in cpu0}
    return server, own1 - own0


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def run_load(spec: LoadSpec) -> LoadResult:
    run = _Run(spec)
    sampler = asyncio.ensure_future(_sampler(run))
    loops = [asyncio.ensure_future(_connection_loop(run)) for _ in range(spec.concurrency)]
    server_cpu, own_cpu = await sampler
    _, pending = await asyncio.wait(loops, timeout=spec.drain_timeout_s)
    for task in pending:  # a stuck answer must not hang the benchmark
        task.cancel()
    await asyncio.gather(*loops, return_exceptions=True)
    t0, t1 = run.window
    done = [r for r in run.records if t0 <= r[2] <= t1]
    ok = [r for r in done if r[3]]
    started = sorted(r[1] for r in run.records if r[3] and t0 <= r[0] <= t1)
    latencies = sorted(r[2] - r[0] for r in ok)
    return LoadResult(
        window_s=t1 - t0, requests=len(ok), errors=len(done) - len(ok),
        ttft_p50_s=_percentile(started, 0.5), ttft_p99_s=_percentile(started, 0.99),
        latency_p50_s=_percentile(latencies, 0.5),
        content_chunks_per_request=(sum(r[4] for r in ok) / len(ok)) if ok and spec.streaming else None,
        server_cpu_s=server_cpu, loadgen_cpu_s=own_cpu, connections_failed=run.connections_failed,
        latency_p99_s=_percentile(latencies, 0.99),
    )


def run_in_own_process(spec: LoadSpec) -> LoadResult:
    """Run this script on ``spec`` in a process of its own (the benchmarks measure from outside the servers)."""
    timeout = spec.warmup_s + spec.duration_s + spec.drain_timeout_s + 60
    done = subprocess.run([sys.executable, __file__, msgspec.json.encode(spec).decode()],
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the load generator failed:\n{done.stderr[-4000:]}")
    return msgspec.json.decode(done.stdout, type=LoadResult)


def main(argv: list[str]) -> int:
    spec = msgspec.json.decode(argv[0], type=LoadSpec)
    try:
        import uvloop
        result = uvloop.run(run_load(spec))
    except ImportError:
        result = asyncio.run(run_load(spec))
    sys.stdout.write(json.dumps(msgspec.to_builtins(result)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
