"""What the orchestrator adds: the same requests through it and straight to the gen worker, same run.

One synthetic worker (``disagg serve --engine synthetic --role both``, K
frontends, a paced decode step) and one orchestrator (``disagg
orchestrator``, K_o processes) in front of it. A ``both`` worker serves the
request as one normal request (the orchestrator never sends a worker a leg
to itself), so the two paths differ by exactly the orchestrator: tokenize,
route, forward, relay. The load generator (``benchmarks/http_loadgen.py``,
its own process, keep-alive, closed loop per connection) sends non-streaming
``/v1/completions`` of ``--max-tokens`` tokens (``ignore_eos``), alternating
direct and through-orchestrator runs at each concurrency, ``--repeats`` times.

Targets (PASS/FAIL lines): added p50 latency <= 2 ms at concurrency 32;
through-orchestrator requests/s >= 0.7x direct. Medians over the repeats.

    python benchmarks/orchestrator_overhead.py [--concurrency 32,256] [--orchestrator-processes 1,2]
        [--num-frontends 2] [--max-tokens 16] [--decode-step-seconds 0.01] [--warmup 1] [--duration 4]
        [--repeats 3] [--out benchmarks/results/orchestrator_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontend_scaling import Server  # noqa: E402  (the sibling script: process start/stop)
from http_loadgen import LoadResult, LoadSpec, run_in_own_process  # noqa: E402

HOST = "127.0.0.1"
WORKER_READY = "disagg serve: ready on"  # not imported: disagg.serve pulls in the worker
ORCHESTRATOR_READY = "disagg orchestrator: ready on"
ADDED_P50_TARGET_MS = 2.0
RPS_RATIO_TARGET = 0.7


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def completion_request(port: int, max_tokens: int) -> str:
    body = json.dumps({"model": "tiny-test", "prompt": "Tell me a story about a dragon.", "max_tokens": max_tokens,
                       "ignore_eos": True, "temperature": 0}, separators=(",", ":"))
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}")


def start_worker(args: argparse.Namespace, model_dir: Path, port: int, log_dir: Path) -> Server:
    argv = [sys.executable, "-m", "disagg.cli", "serve", str(model_dir), "--engine", "synthetic", "--role", "both",
            "--num-frontends", str(args.num_frontends), "--host", HOST, "--port", str(port),
            "--log-level", "warning", "--max-num-seqs", str(max(args.concurrency)),
            "--max-num-batched-tokens", str(max(2048, 64 * max(args.concurrency))),
            "--synthetic-decode-step-seconds", str(args.decode_step_seconds)]
    return Server(argv, WORKER_READY, log_dir, "worker")


def start_orchestrator(model_dir: Path, processes: int, port: int, worker_url: str, log_dir: Path) -> Server:
    config = {"model_dir": str(model_dir), "state_dir": str(log_dir / f"orch-state-{port}"), "host": HOST,
              "port": port, "processes": processes, "log_level": "warning",
              "health": {"interval_seconds": 1.0}, "workers": [{"role": "both", "url": worker_url}]}
    path = log_dir / f"orchestrator-{port}.json"
    path.write_text(json.dumps(config))
    server = Server([sys.executable, "-m", "disagg.cli", "orchestrator", "--config", str(path)], ORCHESTRATOR_READY,
                    log_dir, f"orchestrator-k{processes}")
    deadline = time.monotonic() + 30
    while not _healthy(port):
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError("the orchestrator never became healthy")
        time.sleep(0.1)
    return server


def _healthy(port: int) -> bool:
    import http.client
    try:
        conn = http.client.HTTPConnection(HOST, port, timeout=2)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


def run_load(args: argparse.Namespace, port: int, concurrency: int) -> LoadResult:
    spec = LoadSpec(host=HOST, port=port, request=completion_request(port, args.max_tokens), concurrency=concurrency,
                    warmup_s=args.warmup, duration_s=args.duration, max_requests=10_000_000, streaming=False)
    return run_in_own_process(spec)


def record(path: str, processes: int, concurrency: int, repeat: int, result: LoadResult) -> dict:
    ms = lambda s: None if s is None else round(s * 1e3, 3)  # noqa: E731
    return {"path": path, "orchestrator_processes": processes, "concurrency": concurrency, "repeat": repeat,
            "requests": result.requests, "errors": result.errors, "window_s": round(result.window_s, 3),
            "requests_per_s": round(result.requests / result.window_s, 1),
            "latency_p50_ms": ms(result.latency_p50_s), "latency_p99_ms": ms(result.latency_p99_s),
            "loadgen_cpu_cores": round(result.loadgen_cpu_s / result.window_s, 3)}


def median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return round(statistics.median(values), 3) if values else None


def summarize(runs: list[dict], args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    rows, targets = [], []
    for processes in args.orchestrator_processes:
        for concurrency in args.concurrency:
            pick = lambda path: [r for r in runs if r["path"] == path and r["concurrency"] == concurrency  # noqa: E731
                                 and r["orchestrator_processes"] == processes]
            direct, orch = pick("direct"), pick("orchestrator")
            row = {"orchestrator_processes": processes, "concurrency": concurrency}
            for name, group in (("direct", direct), ("orchestrator", orch)):
                for key in ("requests_per_s", "latency_p50_ms", "latency_p99_ms"):
                    row[f"{name}_{key}"] = median(group, key)
            row["added_p50_ms"] = round(row["orchestrator_latency_p50_ms"] - row["direct_latency_p50_ms"], 3)
            row["added_p99_ms"] = round(row["orchestrator_latency_p99_ms"] - row["direct_latency_p99_ms"], 3)
            row["rps_ratio"] = round(row["orchestrator_requests_per_s"] / row["direct_requests_per_s"], 3)
            rows.append(row)
            label = f"K_o={processes} concurrency={concurrency}"
            targets.append({"target": f"through-orchestrator requests/s >= {RPS_RATIO_TARGET}x direct ({label})",
                            "value": row["rps_ratio"], "pass": row["rps_ratio"] >= RPS_RATIO_TARGET})
            if concurrency == 32:
                targets.append({"target": f"added p50 <= {ADDED_P50_TARGET_MS} ms ({label})",
                                "value": row["added_p50_ms"], "pass": row["added_p50_ms"] <= ADDED_P50_TARGET_MS})
    return rows, targets


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=ints, default=[32, 256])
    parser.add_argument("--orchestrator-processes", type=ints, default=[1, 2])
    parser.add_argument("--num-frontends", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--decode-step-seconds", type=float, default=0.01)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/orchestrator_overhead.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from workers.engine.model.tiny import make_tiny_model  # torch-free

    work = Path(tempfile.mkdtemp(prefix="orch-bench-"))
    model_dir = make_tiny_model(work / "tiny-test", size="test")
    worker_port = free_port()
    worker = start_worker(args, model_dir, worker_port, work)
    runs: list[dict] = []
    try:
        for processes in args.orchestrator_processes:
            orch_port = free_port()
            orchestrator = start_orchestrator(model_dir, processes, orch_port, f"http://{HOST}:{worker_port}", work)
            try:
                for concurrency in args.concurrency:
                    for repeat in range(args.repeats):
                        for path, port in (("direct", worker_port), ("orchestrator", orch_port)):
                            run = record(path, processes, concurrency, repeat, run_load(args, port, concurrency))
                            runs.append(run)
                            print(f"K_o={processes} c={concurrency:<4} {path:<12} {run['requests_per_s']:>8} req/s  "
                                  f"p50 {run['latency_p50_ms']} ms  p99 {run['latency_p99_ms']} ms  "
                                  f"errors {run['errors']}", flush=True)
            finally:
                orchestrator.stop()
    finally:
        worker.stop()
    rows, targets = summarize(runs, args)
    print("\nmedians over the repeats:")
    for row in rows:
        print(f"  K_o={row['orchestrator_processes']} c={row['concurrency']:<4} direct {row['direct_requests_per_s']} "
              f"req/s p50 {row['direct_latency_p50_ms']} p99 {row['direct_latency_p99_ms']} ms | orchestrator "
              f"{row['orchestrator_requests_per_s']} req/s p50 {row['orchestrator_latency_p50_ms']} p99 "
              f"{row['orchestrator_latency_p99_ms']} ms | added p50 {row['added_p50_ms']} ms, "
              f"ratio {row['rps_ratio']}")
    for target in targets:
        print(f"{'PASS' if target['pass'] else 'FAIL'}: {target['target']}: {target['value']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "cpu_count": os.cpu_count(), "runs": runs, "summary": rows, "targets": targets}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
