"""Frontend cost and scaling of one worker, against the bare HTTP stack.

A worker with the synthetic engine at zero compute cost (``disagg serve
MODEL_DIR --engine synthetic --num-frontends K``, the tiny test model for the
tokenizer) serves streaming chat completions of ``--max-tokens`` (16) output
tokens (``ignore_eos``) to a load generator in its own process
(``benchmarks/http_loadgen.py``: raw HTTP/1.1 over asyncio, keep-alive,
closed loop per connection) at each concurrency and each K. Measured per run:

  - requests/s; TTFT p50/p99 (request sent -> first content delta);
  - frontend CPU-seconds per request: utime+stime of the launcher (frontend 0)
    and every attached frontend over the window; the engine apart;
  - the load generator's own CPU (it must stay well under one core).

In the same run, a bare uvicorn app (raw ASGI returning a fixed JSON body,
the same uvicorn settings: uvloop, httptools, no access log, SO_REUSEPORT
socket) on the same port gives the limit of the HTTP stack. Also: the VmRSS
of attached frontends after load, and their spawn -> ready time (process
start from /proc, to the launcher's ready line: an upper bound).

Targets (printed as PASS/FAIL lines with the ratio):
  - frontend CPU per streamed request <= 2.5x the bare app's per request;
  - K frontends give >= 0.8*K x the requests/s of one (only with >= 2K+2
    cores; otherwise TTFT p50 at the highest concurrency, K against 1);
  - attached frontend RSS <= 120 MB; attached spawn -> ready <= 2 s.

Each configuration runs ``--repeats`` times (servers restarted each time);
the summary is the median, with the spread (max-min)/median as the noise.

Two more baselines split the shares: ``bare-starlette`` (the same body
through one Starlette route: the framework's) and ``bare-stream`` (raw ASGI
sending the SSE frames of a zero-cost chat stream: streaming's). Coalescing note: outputs
that queue up while a frontend is behind merge into one SSE frame
(``frontends.engine_client.OutputCollector``), so at zero engine cost the
frames per request drop under load; ``--decode-step-seconds 0.01`` paces
the engine so that every token is its own frame.

    python benchmarks/frontend_scaling.py [--concurrency 64,512] [--num-frontends 1,2]
        [--warmup 1] [--duration 4] [--repeats 3] [--bare-apps raw,starlette,stream]
        [--decode-step-seconds 0] [--out benchmarks/results/frontend_scaling.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_loadgen import LoadResult, LoadSpec, run_in_own_process

from common.processes import stop_process, terminate

READY_LINE = "disagg serve: ready on"  # disagg.serve.READY_MESSAGE, not imported: it pulls in the worker
BARE_READY_LINE = "bare app: ready"  # bare_app.READY_LINE
BARE_APP = Path(__file__).resolve().parent / "bare_app.py"
HOST = "127.0.0.1"
CLK_TCK = os.sysconf("SC_CLK_TCK")
RSS_TARGET_MB = 120.0
READY_TARGET_S = 2.0
CPU_RATIO_TARGET = 2.5
SCALING_TARGET = 0.8


# --- /proc -------------------------------------------------------------------


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def start_wall_time(pid: int) -> float:
    """When ``pid`` started, as a time.time() value (10 ms resolution)."""
    fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime"))
    return boot + int(fields[19]) / CLK_TCK  # field 22 of proc(5): starttime in clock ticks after boot


# --- servers -----------------------------------------------------------------


class Server:
    """A server process started by the benchmark; ``stop()`` ends it and everything it started."""

    def __init__(self, argv: list[str], ready_line: str, log_dir: Path, name: str, timeout: float = 120.0) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.spawned_at = time.time()
        with open(self.log_path, "w") as log:
            self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True)
        self.ready_at: float | None = None
        ready = threading.Event()

        def read_stdout() -> None:
            for line in self.popen.stdout:
                if line.startswith(ready_line) and self.ready_at is None:
                    self.ready_at = time.time()
                    ready.set()

        threading.Thread(target=read_stdout, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not start; its log:\n{self.log_path.read_text()[-4000:]}")
        self.engine_pids = [p for p in children(self.popen.pid) if "workers.engine_proc" in cmdline(p)]
        self.attached_pids = [p for p in children(self.popen.pid) if p not in self.engine_pids]
        self.frontend_pids = [self.popen.pid, *self.attached_pids]

    def stop(self) -> None:
        """SIGTERM the launcher (it stops its children); SIGKILL anything left after the wait."""
        started = [*getattr(self, "attached_pids", []), *getattr(self, "engine_pids", [])]
        stop_process(self.popen, 45)
        for pid in terminate(started, 10, sig=None):  # its children: they were told to stop by the launcher
            print(f"warning: {self.name}: pid {pid} outlived its launcher; killed it", file=sys.stderr)


def start_worker(args: argparse.Namespace, model_dir: Path, num_frontends: int, log_dir: Path) -> Server:
    argv = [sys.executable, "-m", "disagg.cli", "serve", str(model_dir), "--engine", "synthetic",
            "--num-frontends", str(num_frontends), "--host", HOST, "--port", str(args.port),
            "--log-level", "warning", "--max-num-seqs", str(max(args.concurrency)),
            "--max-num-batched-tokens", str(max(2048, 64 * max(args.concurrency))),
            "--synthetic-decode-step-seconds", str(args.decode_step_seconds)]
    return Server(argv, READY_LINE, log_dir, f"worker-k{num_frontends}")


def start_bare_app(args: argparse.Namespace, kind: str, log_dir: Path) -> Server:
    argv = [sys.executable, str(BARE_APP), kind, "--port", str(args.port)]
    return Server(argv, BARE_READY_LINE, log_dir, f"bare-{kind}")


# --- requests ----------------------------------------------------------------


def chat_body(model_name: str, max_tokens: int, include_usage: bool = False) -> bytes:
    body = {"model": model_name, "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body, separators=(",", ":")).encode()


def raw_request(body: bytes, port: int) -> str:
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n")
    return head + body.decode("latin-1")


def check_worker(port: int, model_name: str, max_tokens: int) -> None:
    """One streamed request with usage: the worker answers max_tokens tokens, never fewer."""
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    conn.request("POST", "/v1/chat/completions", chat_body(model_name, max_tokens, include_usage=True),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    usage = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {") and '"usage"' in line]
    tokens = usage[-1]["usage"]["completion_tokens"] if usage else None
    if response.status != 200 or tokens != max_tokens:
        raise RuntimeError(f"check request: status {response.status}, completion_tokens {tokens}:\n{text[:2000]}")


def run_load(args: argparse.Namespace, request: str, concurrency: int, streaming: bool,
             server_pids: dict[str, list[int]]) -> LoadResult:
    spec = LoadSpec(host=HOST, port=args.port, request=request, concurrency=concurrency, warmup_s=args.warmup,
                    duration_s=args.duration, max_requests=args.max_requests, streaming=streaming,
                    server_pids=server_pids)
    return run_in_own_process(spec)


def run_record(server: str, k: int | None, concurrency: int, repeat: int, result: LoadResult) -> dict:
    n = max(result.requests, 1)
    frontend_cpu = sum(result.server_cpu_s.get("frontend", []))
    engine_cpu = sum(result.server_cpu_s.get("engine", []))
    def ms(s):
        return None if s is None else round(s * 1e3, 3)
    return {
        "server": server, "num_frontends": k, "concurrency": concurrency, "repeat": repeat,
        "window_s": round(result.window_s, 3), "requests": result.requests, "errors": result.errors,
        "requests_per_s": round(result.requests / result.window_s, 1),
        "ttft_p50_ms": ms(result.ttft_p50_s), "ttft_p99_ms": ms(result.ttft_p99_s),
        "latency_p50_ms": ms(result.latency_p50_s),
        "frontend_cpu_ms_per_request": round(frontend_cpu / n * 1e3, 4),
        "per_frontend_cpu_s": [round(c, 2) for c in result.server_cpu_s.get("frontend", [])],
        "engine_cpu_ms_per_request": round(engine_cpu / n * 1e3, 4) if server == "disagg" else None,
        "loadgen_cpu_cores": round(result.loadgen_cpu_s / result.window_s, 3),
        "loadgen_cpu_ms_per_request": round(result.loadgen_cpu_s / n * 1e3, 4),
        "content_chunks_per_request": result.content_chunks_per_request,
        "connections_failed": result.connections_failed,
    }


# --- one repeat ----------------------------------------------------------------


def measure_worker(args: argparse.Namespace, model_dir: Path, k: int, repeat: int, log_dir: Path,
                   report: dict) -> None:
    server = start_worker(args, model_dir, k, log_dir)
    try:
        attached_ready = [round(server.ready_at - start_wall_time(p), 3) for p in server.attached_pids]
        report["startup"].append({"num_frontends": k, "repeat": repeat,
                                  "spawn_to_ready_s": round(server.ready_at - server.spawned_at, 3),
                                  "attached_spawn_to_ready_s": attached_ready})
        check_worker(args.port, model_dir.name, args.max_tokens)
        request = raw_request(chat_body(model_dir.name, args.max_tokens), args.port)
        pids = {"frontend": server.frontend_pids, "engine": server.engine_pids}
        for concurrency in args.concurrency:
            result = run_load(args, request, concurrency, True, pids)
            report["runs"].append(run_record("disagg", k, concurrency, repeat, result))
            print_run(report["runs"][-1])
            report["rss"].append({"num_frontends": k, "concurrency": concurrency, "repeat": repeat,
                                  "attached_rss_mb": [rss_mb(p) for p in server.attached_pids],
                                  "launcher_rss_mb": rss_mb(server.popen.pid),
                                  "engine_rss_mb": [rss_mb(p) for p in server.engine_pids]})
    finally:
        server.stop()


def measure_bare_app(args: argparse.Namespace, kind: str, model_name: str, repeat: int, log_dir: Path,
                     report: dict) -> None:
    server = start_bare_app(args, kind, log_dir)
    try:
        request = raw_request(chat_body(model_name, args.max_tokens), args.port)
        for concurrency in args.concurrency:
            result = run_load(args, request, concurrency, False, {"frontend": [server.popen.pid]})
            report["runs"].append(run_record(f"bare-{kind}", None, concurrency, repeat, result))
            print_run(report["runs"][-1])
    finally:
        server.stop()


def print_run(run: dict) -> None:
    name = f"K={run['num_frontends']}" if run["server"] == "disagg" else run["server"]
    ttft = f"TTFT p50 {run['ttft_p50_ms']:.1f} p99 {run['ttft_p99_ms']:.1f} ms" if run["server"] == "disagg" else ""
    print(f"  [{run['repeat']}] {name:14} c={run['concurrency']:<4} {run['requests_per_s']:8.1f} req/s  "
          f"frontend {run['frontend_cpu_ms_per_request']:.3f} ms CPU/req  {ttft}  "
          f"loadgen {run['loadgen_cpu_cores']:.2f} cores  errors {run['errors']}", flush=True)


# --- summary and targets -------------------------------------------------------------


_METRICS = ("requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "frontend_cpu_ms_per_request",
            "engine_cpu_ms_per_request", "loadgen_cpu_cores", "loadgen_cpu_ms_per_request",
            "content_chunks_per_request")


def median_and_spread(values: list[float]) -> dict:
    median = statistics.median(values)
    spread = (max(values) - min(values)) / median if median else 0.0
    return {"median": round(median, 4), "spread": round(spread, 3), "values": values}


def summarize(report: dict) -> dict:
    groups: dict[str, dict] = {}
    for run in report["runs"]:
        key = f"{run['server']}" + (f"/k{run['num_frontends']}" if run["server"] == "disagg" else "") \
            + f"/c{run['concurrency']}"
        groups.setdefault(key, []).append(run)
    summary = {}
    for key, runs in groups.items():
        summary[key] = {m: median_and_spread([r[m] for r in runs]) for m in _METRICS
                        if all(r[m] is not None for r in runs)}
        summary[key]["errors"] = sum(r["errors"] for r in runs)
    return summary


def target(name: str, value: float | None, limit: float, higher_is_better: bool = False, note: str = "") -> dict:
    if value is None:
        return {"name": name, "value": None, "limit": limit, "passed": None, "note": note}
    passed = value >= limit if higher_is_better else value <= limit
    return {"name": name, "value": round(value, 3), "limit": limit, "passed": passed, "note": note}


def evaluate_targets(args: argparse.Namespace, report: dict) -> list[dict]:
    s, cores, targets = report["summary"], report["config"]["cores"], []
    def med(key, metric):
        return s.get(key, {}).get(metric, {}).get("median")
    for kind in args.bare_apps:
        for k in args.num_frontends:
            for c in args.concurrency:
                frontend = med(f"disagg/k{k}/c{c}", "frontend_cpu_ms_per_request")
                bare = med(f"bare-{kind}/c{c}", "frontend_cpu_ms_per_request")
                ratio = frontend / bare if frontend and bare else None
                targets.append(target(f"frontend CPU/request vs bare-{kind}, K={k} c={c}", ratio, CPU_RATIO_TARGET,
                                      note=f"{frontend} ms vs {bare} ms"))
    top = max(args.concurrency)
    for k in args.num_frontends:
        if k == 1:
            continue
        if cores >= 2 * k + 2:
            rps, rps1 = med(f"disagg/k{k}/c{top}", "requests_per_s"), med(f"disagg/k1/c{top}", "requests_per_s")
            ratio = rps / rps1 / k if rps and rps1 else None
            targets.append(target(f"requests/s K={k} vs K=1 at c={top}, per frontend", ratio, SCALING_TARGET,
                                  higher_is_better=True, note=f"{rps} vs {rps1} req/s"))
        else:
            ttft, ttft1 = med(f"disagg/k{k}/c{top}", "ttft_p50_ms"), med(f"disagg/k1/c{top}", "ttft_p50_ms")
            targets.append({"name": f"requests/s K={k} vs K=1", "value": None, "limit": SCALING_TARGET,
                            "passed": None, "note": f"needs >= {2 * k + 2} cores, have {cores}; TTFT p50 at "
                            f"c={top}: K={k} {ttft} ms vs K=1 {ttft1} ms (ratio "
                            f"{ttft / ttft1 if ttft and ttft1 else float('nan'):.2f})"})
    rss = [mb for r in report["rss"] for mb in r["attached_rss_mb"] if mb is not None]
    targets.append(target("attached frontend RSS after load, MB (max)", max(rss) if rss else None, RSS_TARGET_MB))
    ready = [max(r["attached_spawn_to_ready_s"]) for r in report["startup"] if r["attached_spawn_to_ready_s"]]
    targets.append(target("attached frontend spawn -> ready, s (median of per-start max)",
                          statistics.median(ready) if ready else None, READY_TARGET_S,
                          note="upper bound: process start to the launcher's ready line"))
    return targets


def print_summary(report: dict) -> None:
    print("\nsummary (median over repeats; spread = (max-min)/median)")
    for key, metrics in report["summary"].items():
        parts = [f"{m} {v['median']:g} (±{v['spread'] * 100:.0f}%)" for m, v in metrics.items() if m != "errors"]
        print(f"  {key:20} " + ", ".join(parts) + f", errors {metrics['errors']}")
    for k in sorted({r["num_frontends"] for r in report["startup"]}):
        ups = [r["spawn_to_ready_s"] for r in report["startup"] if r["num_frontends"] == k]
        print(f"  worker K={k}: spawn -> ready {statistics.median(ups):.2f} s (median)")
    print("\ntargets")
    for t in report["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "N/A "}[t["passed"]]
        value = "n/a" if t["value"] is None else f"{t['value']:g}"
        print(f"  {verdict} {t['name']}: {value} (limit {t['limit']:g}){'  ' + t['note'] if t['note'] else ''}")


# --- main ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def write_report(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {out} ({report['wall_s']} s)")


def default_num_frontends() -> list[int]:
    cores = len(os.sched_getaffinity(0))
    return [k for k in (1, 2, 4, 8) if k <= max(2, (cores - 2) // 2)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    def ints(text):
        return [int(x) for x in text.split(",")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=ints, default=[64, 512], help="comma-separated (default 64,512)")
    parser.add_argument("--num-frontends", type=ints, default=None,
                        help="comma-separated K values (default 1,2,4,8 up to max(2, (cores-2)/2))")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of load before the window")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds in the measured window")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-requests", type=int, default=500_000, help="bound on requests per run")
    parser.add_argument("--port", type=int, default=None, help="default: a free port")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "frontend_scaling.json"))
    parser.add_argument("--bare-apps", type=lambda text: text.split(","), default=["raw", "starlette", "stream"],
                        help="baselines, comma-separated: raw (raw ASGI), starlette (one Starlette route)")
    parser.add_argument("--decode-step-seconds", type=float, default=0.0,
                        help="synthetic engine seconds per decode step (0: zero compute cost)")
    args = parser.parse_args(argv)
    args.num_frontends = args.num_frontends or default_num_frontends()
    args.port = free_port() if args.port is None else args.port
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from workers.engine.model.tiny import make_tiny_model

    config = dict(vars(args))
    config["cores"] = len(os.sched_getaffinity(0))
    report: dict = {"config": config, "runs": [], "startup": [], "rss": []}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="frontend-bench-") as tmp:
        model_dir = Path(tmp) / "tiny-test"
        make_tiny_model(model_dir, size="test")
        for repeat in range(args.repeats):
            print(f"repeat {repeat + 1}/{args.repeats}", flush=True)
            for k in args.num_frontends:
                measure_worker(args, model_dir, k, repeat, Path(tmp), report)
            for kind in args.bare_apps:
                measure_bare_app(args, kind, model_dir.name, repeat, Path(tmp), report)
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["summary"] = summarize(report)
    report["targets"] = evaluate_targets(args, report)
    print_summary(report)
    write_report(report, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
