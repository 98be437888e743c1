"""What the orchestrator adds: its CPU per proxied request, and latency against the same requests
sent straight to a worker in the same run.

Synthetic workers (``disagg serve --engine synthetic``, K frontends, a paced
decode step) and one orchestrator (``disagg orchestrator``, K_o processes) in
front of them; optionally the Rust routers from the package index
(``--routers sglang,vllm``: ``sglang-router``, ``vllm-router``; bench-only,
not dependencies) in front of the same worker, side by side. Scenarios:

- ``agg``: one ``both`` worker, non-streaming ``/v1/completions``: one leg
  (the orchestrator never sends a worker a leg to itself).
- ``agg-stream``: the same worker, streamed ``/v1/chat/completions`` (every
  token its own SSE event): one leg, relayed as it arrives.
- ``disagg``: a ctx and a gen worker (cluster key, conditional disaggregation
  off), non-streaming ``/v1/completions``: two legs per request; the direct
  baseline is the gen worker serving it alone.

The load generator (``benchmarks/http_loadgen.py``, its own process,
keep-alive, closed loop per connection) sends ``--max-tokens`` tokens
(``ignore_eos``), alternating direct and proxied runs at each concurrency,
``--repeats`` times. CPU seconds come from ``/proc/<pid>/stat`` of every
orchestrator (or router) process and every worker process, over the load
generator's window; CPU per request is those seconds over the requests
completed in it. Medians over the repeats.

Targets (PASS/FAIL lines): orchestrator CPU per request <= 0.25 ms (agg), <= 0.6 ms
(agg-stream), <= 0.5 ms (disagg, both legs) at the highest concurrency with K_o=1;
added p50 latency <= 2 ms at concurrency 32; proxied requests/s >= 0.7x direct.

    python benchmarks/orchestrator_overhead.py [--scenarios agg,agg-stream,disagg] [--concurrency 32,256]
        [--orchestrator-processes 1,2] [--routers sglang,vllm] [--num-frontends 2] [--max-tokens 16]
        [--decode-step-seconds 0.01] [--warmup 1] [--duration 4] [--repeats 3]
        [--out benchmarks/results/orchestrator_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontend_scaling import Server, children, free_port
from http_loadgen import LoadResult, LoadSpec, run_in_own_process

HOST = "127.0.0.1"
WORKER_READY = "disagg serve: ready on"  # not imported: disagg.serve pulls in the worker
ORCHESTRATOR_READY = "disagg orchestrator: ready on"
ADDED_P50_TARGET_MS = 2.0
RPS_RATIO_TARGET = 0.7
CPU_TARGET_MS = {"agg": 0.25, "agg-stream": 0.6, "disagg": 0.5}
SCENARIOS = ("agg", "agg-stream", "disagg")
ROUTERS = {  # name -> argv before the worker URLs (both take --host, --port, --worker-urls, --policy)
    "sglang": [sys.executable, "-m", "sglang_router.launch_router", "--log-level", "warn"],
    "vllm": [str(Path(sys.executable).with_name("vllm-router")), "--log-level", "warning"],
}


def scenario_request(scenario: str, port: int, max_tokens: int) -> str:
    if scenario == "agg-stream":
        path = "/v1/chat/completions"
        body = {"model": "tiny-test", "messages": [{"role": "user", "content": "Tell me a story about a dragon."}],
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    else:
        path = "/v1/completions"
        body = {"model": "tiny-test", "prompt": "Tell me a story about a dragon.", "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0}
    text = json.dumps(body, separators=(",", ":"))
    return (f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(text)}\r\n\r\n{text}")


def start_worker(args: argparse.Namespace, model_dir: Path, role: str, port: int, log_dir: Path,
                 key_file: Path | None = None) -> Server:
    argv = [sys.executable, "-m", "disagg.cli", "serve", str(model_dir), "--engine", "synthetic", "--role", role,
            "--num-frontends", str(args.num_frontends), "--host", HOST, "--port", str(port),
            "--log-level", "warning", "--max-num-seqs", str(max(args.concurrency)),
            "--max-num-batched-tokens", str(max(2048, 64 * max(args.concurrency))),
            "--synthetic-decode-step-seconds", str(args.decode_step_seconds)]
    if key_file is not None:
        argv += ["--cluster-key-file", str(key_file), "--kv-port", "0"]
    return Server(argv, WORKER_READY, log_dir, f"worker-{role}-{port}")


def start_orchestrator(model_dir: Path, processes: int, port: int, workers: list[dict], log_dir: Path) -> Server:
    config = {"model_dir": str(model_dir), "state_dir": str(log_dir / f"orch-state-{port}"), "host": HOST,
              "port": port, "processes": processes, "log_level": "warning",
              "conditional": {"enabled": False},  # every disagg request takes both legs
              "health": {"interval_seconds": 1.0}, "workers": workers}
    path = log_dir / f"orchestrator-{port}.json"
    path.write_text(json.dumps(config))
    server = Server([sys.executable, "-m", "disagg.cli", "orchestrator", "--config", str(path)], ORCHESTRATOR_READY,
                    log_dir, f"orchestrator-k{processes}")
    wait_until(lambda: _status(port, "GET", "/health") == 200, 30, server, "the orchestrator never became healthy")
    return server


class Router:
    """A Rust router from the package index in front of the same worker (bench-only)."""

    def __init__(self, name: str, port: int, worker_url: str, log_dir: Path, request: str) -> None:
        self.name = name
        argv = [*ROUTERS[name], "--host", HOST, "--port", str(port), "--policy", "round_robin",
                "--worker-urls", worker_url]
        with open(log_dir / f"router-{name}.log", "w") as log:
            self.popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        probe = request.replace(f"{HOST}:0", f"{HOST}:{port}")
        wait_until(lambda: _raw_status(port, probe) == 200, 60, self, f"{name} router never answered a request")

    @property
    def pids(self) -> list[int]:
        return [self.popen.pid, *children(self.popen.pid)]

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def wait_until(ready, seconds: float, server, message: str) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(message)
        time.sleep(0.1)


def _status(port: int, method: str, path: str) -> int | None:
    import http.client
    try:
        conn = http.client.HTTPConnection(HOST, port, timeout=2)
        conn.request(method, path)
        status = conn.getresponse().status
        conn.close()
        return status
    except OSError:
        return None


def _raw_status(port: int, request: str) -> int | None:
    try:
        with socket.create_connection((HOST, port), timeout=5) as s:
            s.sendall(request.encode("latin-1"))
            head = s.recv(64)
        return int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else None
    except (OSError, ValueError, IndexError):
        return None


def worker_pids(workers: list[Server]) -> list[int]:
    return [p for w in workers for p in (*w.frontend_pids, *w.engine_pids)]


def run_load(args: argparse.Namespace, scenario: str, port: int, concurrency: int,
             pids: dict[str, list[int]]) -> LoadResult:
    spec = LoadSpec(host=HOST, port=port, request=scenario_request(scenario, port, args.max_tokens),
                    concurrency=concurrency, warmup_s=args.warmup, duration_s=args.duration,
                    max_requests=10_000_000, streaming=scenario == "agg-stream", server_pids=pids)
    return run_in_own_process(spec)


def record(scenario: str, path: str, processes: int, concurrency: int, repeat: int, result: LoadResult) -> dict:
    def ms(s):
        return None if s is None else round(s * 1e3, 3)
    n = max(result.requests, 1)
    proxy_cpu = result.server_cpu_s.get("proxy", [])
    return {"scenario": scenario, "path": path, "orchestrator_processes": processes, "concurrency": concurrency,
            "repeat": repeat, "requests": result.requests, "errors": result.errors,
            "window_s": round(result.window_s, 3), "requests_per_s": round(result.requests / result.window_s, 1),
            "latency_p50_ms": ms(result.latency_p50_s), "latency_p99_ms": ms(result.latency_p99_s),
            "ttft_p50_ms": ms(result.ttft_p50_s) if scenario == "agg-stream" else None,
            "proxy_cpu_ms_per_request": round(sum(proxy_cpu) / n * 1e3, 4) if proxy_cpu else None,
            "proxy_cpu_s_per_process": [round(c, 3) for c in proxy_cpu],
            "worker_cpu_ms_per_request": round(sum(result.server_cpu_s.get("worker", [])) / n * 1e3, 4),
            "loadgen_cpu_cores": round(result.loadgen_cpu_s / result.window_s, 3)}


def measure_scenario(args: argparse.Namespace, scenario: str, model_dir: Path, work: Path, runs: list[dict]) -> None:
    workers: list[Server] = []
    key_file = None
    if scenario == "disagg":
        key_file = work / "cluster.key"
        key_file.write_bytes(secrets.token_hex(32).encode())
        key_file.chmod(0o600)
    try:
        if scenario == "disagg":
            ctx_port, gen_port = free_port(), free_port()
            workers.append(start_worker(args, model_dir, "ctx", ctx_port, work, key_file))
            workers.append(start_worker(args, model_dir, "gen", gen_port, work, key_file))
            registered = [{"role": "ctx", "url": f"http://{HOST}:{ctx_port}"},
                          {"role": "gen", "url": f"http://{HOST}:{gen_port}"}]
        else:
            gen_port = free_port()
            workers.append(start_worker(args, model_dir, "both", gen_port, work))
            registered = [{"role": "both", "url": f"http://{HOST}:{gen_port}"}]
        wpids = worker_pids(workers)
        proxies: list[tuple[str, int, int, object]] = []  # (path label, K_o, port, starter)
        for processes in args.orchestrator_processes:
            proxies.append(("orchestrator", processes, free_port(),
                            lambda port, k=processes: start_orchestrator(model_dir, k, port, registered, work)))
        if scenario != "disagg":
            for name in args.routers:
                proxies.append((f"{name}-router", 1, free_port(),
                                lambda port, name=name: Router(name, port, registered[0]["url"], work,
                                                               scenario_request(scenario, 0, args.max_tokens))))
        for label, processes, port, start in proxies:
            server = start(port)
            pids = server.pids if isinstance(server, Router) else [server.popen.pid, *children(server.popen.pid)]
            try:
                for concurrency in args.concurrency:
                    for repeat in range(args.repeats):
                        for path, target in (("direct", gen_port), (label, port)):
                            result = run_load(args, scenario, target, concurrency,
                                              {"worker": wpids, **({"proxy": pids} if path != "direct" else {})})
                            run = record(scenario, path, processes, concurrency, repeat, result)
                            runs.append(run)
                            print_run(run)
            finally:
                server.stop()
    finally:
        for worker in workers:
            worker.stop()


def print_run(run: dict) -> None:
    cpu = "" if run["proxy_cpu_ms_per_request"] is None else (
        f"  proxy CPU {run['proxy_cpu_ms_per_request']} ms/req {run['proxy_cpu_s_per_process']} s")
    ttft = "" if run["ttft_p50_ms"] is None else f"  TTFT p50 {run['ttft_p50_ms']} ms"
    print(f"{run['scenario']:<10} K_o={run['orchestrator_processes']} c={run['concurrency']:<4} {run['path']:<14} "
          f"{run['requests_per_s']:>8} req/s  p50 {run['latency_p50_ms']} ms  p99 {run['latency_p99_ms']} ms{ttft}"
          f"  worker CPU {run['worker_cpu_ms_per_request']} ms/req{cpu}  errors {run['errors']}", flush=True)


def median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return round(statistics.median(values), 4) if values else None


def summarize(runs: list[dict], args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    rows, targets = [], []
    keys = sorted({(r["scenario"], r["path"], r["orchestrator_processes"], r["concurrency"]) for r in runs
                   if r["path"] != "direct"}, key=lambda k: (SCENARIOS.index(k[0]), k[1], k[2], k[3]))
    top = max(args.concurrency)
    for scenario, path, processes, concurrency in keys:
        direct, proxied = ([r for r in runs if r["scenario"] == scenario and r["path"] == p
                            and r["concurrency"] == concurrency and r["orchestrator_processes"] == processes]
                           for p in ("direct", path))
        row = {"scenario": scenario, "path": path, "orchestrator_processes": processes, "concurrency": concurrency}
        for name, group in (("direct", direct), ("proxied", proxied)):
            for key in ("requests_per_s", "latency_p50_ms", "latency_p99_ms", "ttft_p50_ms",
                        "worker_cpu_ms_per_request"):
                row[f"{name}_{key}"] = median(group, key)
        row["proxy_cpu_ms_per_request"] = median(proxied, "proxy_cpu_ms_per_request")
        row["added_p50_ms"] = round(row["proxied_latency_p50_ms"] - row["direct_latency_p50_ms"], 3)
        row["rps_ratio"] = round(row["proxied_requests_per_s"] / row["direct_requests_per_s"], 3)
        rows.append(row)
        if path != "orchestrator":
            continue
        label = f"{scenario} K_o={processes} concurrency={concurrency}"
        targets.append({"target": f"orchestrator requests/s >= {RPS_RATIO_TARGET}x direct ({label})",
                        "value": row["rps_ratio"], "pass": row["rps_ratio"] >= RPS_RATIO_TARGET})
        if concurrency == 32:
            targets.append({"target": f"added p50 <= {ADDED_P50_TARGET_MS} ms ({label})",
                            "value": row["added_p50_ms"], "pass": row["added_p50_ms"] <= ADDED_P50_TARGET_MS})
        if processes == 1 and concurrency == top:
            cpu, limit = row["proxy_cpu_ms_per_request"], CPU_TARGET_MS[scenario]
            targets.append({"target": f"orchestrator CPU per request <= {limit} ms ({label})",
                            "value": cpu, "pass": cpu is not None and cpu <= limit})
    return rows, targets


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    def ints(text):
        return [int(x) for x in text.split(",")]
    def names(text):
        return [x for x in text.split(",") if x]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", type=names, default=list(SCENARIOS))
    parser.add_argument("--concurrency", type=ints, default=[32, 256])
    parser.add_argument("--orchestrator-processes", type=ints, default=[1, 2])
    parser.add_argument("--routers", type=names, default=[],
                        help="also measure these Rust routers when installed: sglang, vllm (bench-only)")
    parser.add_argument("--num-frontends", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--decode-step-seconds", type=float, default=0.01)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/orchestrator_overhead.json"))
    args = parser.parse_args(argv)
    for scenario in args.scenarios:
        if scenario not in SCENARIOS:
            parser.error(f"--scenarios: unknown {scenario!r} (one of {', '.join(SCENARIOS)})")
    for name in args.routers:
        if name not in ROUTERS:
            parser.error(f"--routers: unknown {name!r} (one of {', '.join(ROUTERS)})")
    args.routers = [name for name in args.routers if _installed(name)]
    return args


def _installed(name: str) -> bool:
    found = (Path(ROUTERS[name][0]).exists() if name == "vllm"
             else subprocess.run([sys.executable, "-c", "import sglang_router"], capture_output=True).returncode == 0)
    if not found:
        print(f"note: {name}-router is not installed (pip install {name}-router); skipped", file=sys.stderr)
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from workers.engine.model.tiny import make_tiny_model  # torch-free

    work = Path(tempfile.mkdtemp(prefix="orch-bench-"))
    model_dir = make_tiny_model(work / "tiny-test", size="test")
    runs: list[dict] = []
    for scenario in args.scenarios:
        measure_scenario(args, scenario, model_dir, work, runs)
    rows, targets = summarize(runs, args)
    print("\nmedians over the repeats (CPU per request from /proc, over the load window):")
    for row in rows:
        print(f"  {row['scenario']:<10} {row['path']:<14} K_o={row['orchestrator_processes']} "
              f"c={row['concurrency']:<4} proxy CPU {row['proxy_cpu_ms_per_request']} ms/req | direct "
              f"{row['direct_requests_per_s']} req/s p50 {row['direct_latency_p50_ms']} ms | proxied "
              f"{row['proxied_requests_per_s']} req/s p50 {row['proxied_latency_p50_ms']} ms | added p50 "
              f"{row['added_p50_ms']} ms, ratio {row['rps_ratio']} | worker CPU/req direct "
              f"{row['direct_worker_cpu_ms_per_request']} proxied {row['proxied_worker_cpu_ms_per_request']} ms")
    report_targets(args, targets, runs=runs, summary=rows)
    return 0


def report_targets(args: argparse.Namespace, targets: list[dict], **sections) -> None:
    """Print the PASS/FAIL lines and write the JSON report (config, CPU count, targets, ``sections``)."""
    for target in targets:
        print(f"{'PASS' if target['pass'] else 'FAIL'}: {target['target']}: {target['value']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "cpu_count": os.cpu_count(), **sections, "targets": targets}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
