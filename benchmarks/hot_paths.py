"""Hot paths of one worker (issue 17, items 1-5): frontend and engine CPU per request, the capacity model.

All figures are CPU-seconds (utime + stime from /proc) of the server processes
over a measured window, divided by the requests completed in it, so they hold
on a shared, noisy machine; a bare uvicorn app streaming the same SSE frames
(``benchmarks/bare_app.py stream``) runs in the same invocation as the baseline
of the HTTP stack. Workers run the synthetic engine (``disagg serve MODEL_DIR
--engine synthetic``, the tiny test model for the tokenizer) and serve
streamed chat completions (``ignore_eos``) to ``benchmarks/http_loadgen.py``.

1. Frontend CPU per streamed request: K=1, c=64, ``--max-tokens`` (16) output
   tokens, the engine paced (``--paced-step-seconds``, 10 ms a decode step) so
   that every token is its own SSE event (the events per request are printed).
   Per SSE event beyond the first: the CPU that events add with the tokens
   and the request's lifetime fixed, between ``stream_interval`` 1 and 16:
   (cpu(1) - cpu(16)) / (events(1) - events(16)); also printed against a
   ``max_tokens: 1`` request, which also shortens the request's lifetime.
   Targets: <= 0.15 ms per request, <= 6 us per event beyond the first.
   The floor under the per-event figure, measured in the same run
   (``benchmarks/write_floor.py``): the CPU of a bare uvloop process writing
   one SSE-sized frame per stream to 64 paced streams, nothing else; the
   per-event figure minus it is the frontend's own work per event.
2. Engine CPU per request: K=4 lanes, c=512, zero step cost, 16 tokens, the
   engine process alone fed by raw lanes (``benchmarks/engine_lanes.py``), so
   that it, not the frontends, is the bottleneck; the same through a worker's
   4 HTTP frontends is printed beside it (skip it with ``--skip http-engine``).
   Target: <= 0.06 ms.
3. Capacity model: requests/s one core of each gives (1 / CPU per request);
   the engine's ceiling must be >= 4x one frontend's (so K=4 is not engine-bound).
4. K scaling (K=4 >= 3.2x K=1 req/s at c=512, TTFT p50 <= 0.35x) needs >= 10
   cores: printed as N/A with what it needs when the machine has fewer
   (``benchmarks/frontend_scaling.py --num-frontends 1,4`` runs it).
5. Stream interval: frontend CPU per request at ``stream_interval`` 1, 4, 16
   (the per-request body field; the worker's default is 1).

    python benchmarks/hot_paths.py [--repeats 1] [--duration 4] [--intervals 1,4,16]
        [--skip frontend,floor,engine,http-engine,bare] [--out benchmarks/results/hot_paths.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_lanes import measure_engine_lanes
from frontend_scaling import (
    HOST,
    READY_LINE,
    Server,
    check_worker,
    free_port,
    raw_request,
    start_bare_app,
    write_report,
)
from http_loadgen import LoadResult, LoadSpec, run_in_own_process
from write_floor import measure_write_floor

FRONTEND_MS_TARGET = 0.15
EVENT_US_TARGET = 6.0
ENGINE_MS_TARGET = 0.06
CAPACITY_TARGET = 4.0
SCALING_CORES = 10
FLOOR_FRAME_BYTES = 200  # a chat chunk of one token in its chunked framing


def start_worker(args: argparse.Namespace, model_dir: Path, k: int, step_s: float, log_dir: Path) -> Server:
    argv = [sys.executable, "-m", "disagg.cli", "serve", str(model_dir), "--engine", "synthetic",
            "--num-frontends", str(k), "--host", HOST, "--port", str(args.port), "--log-level", "warning",
            "--max-num-seqs", "1024", "--max-num-batched-tokens", str(64 * 1024),
            "--synthetic-decode-step-seconds", str(step_s)]
    return Server(argv, READY_LINE, log_dir, f"worker-k{k}-step{step_s:g}")


def body(model: str, max_tokens: int, interval: int | None) -> bytes:
    payload: dict = {"model": model, "messages": [{"role": "user", "content": "Tell me a story."}],
                     "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    if interval is not None:
        payload["stream_interval"] = interval
    return json.dumps(payload, separators=(",", ":")).encode()


def load(args: argparse.Namespace, request: str, concurrency: int, pids: dict[str, list[int]]) -> LoadResult:
    spec = LoadSpec(host=HOST, port=args.port, request=request, concurrency=concurrency, warmup_s=args.warmup,
                    duration_s=args.duration, max_requests=10_000_000, streaming=True, server_pids=pids)
    return run_in_own_process(spec)


def per_request(result: LoadResult, role: str) -> float:
    """CPU milliseconds per completed request of the processes in ``role``."""
    return sum(result.server_cpu_s.get(role, [])) / max(result.requests, 1) * 1e3


def record(name: str, result: LoadResult) -> dict:
    row = {"name": name, "requests": result.requests, "errors": result.errors,
           "requests_per_s": round(result.requests / result.window_s, 1),
           "frontend_ms": round(per_request(result, "frontend"), 4),
           "engine_ms": round(per_request(result, "engine"), 4),
           "events_per_request": result.content_chunks_per_request,
           "ttft_p50_ms": None if result.ttft_p50_s is None else round(result.ttft_p50_s * 1e3, 2)}
    print(f"  {name:34} {row['requests_per_s']:8.1f} req/s  frontend {row['frontend_ms']:.4f} ms  engine "
          f"{row['engine_ms']:.4f} ms CPU/req  events/req {row['events_per_request']}  errors {row['errors']}",
          flush=True)
    return row


def measure_floor(args: argparse.Namespace, rows: list[dict]) -> None:
    floor = measure_write_floor(64, args.paced_step_seconds, FLOOR_FRAME_BYTES, args.warmup, args.duration)
    rows.append({"name": "write floor", "requests": None, "errors": 0, "requests_per_s": None, "frontend_ms": None,
                 "engine_ms": None, "events_per_request": None, "ttft_p50_ms": None,
                 "write_floor_us": floor["us_per_write"]})
    print(f"  {'write floor (64 paced streams)':34} {floor['us_per_write']:.2f} us CPU per {FLOOR_FRAME_BYTES}-byte "
          f"write ({floor['writes']} writes)", flush=True)


def measure_frontend(args: argparse.Namespace, model_dir: Path, log_dir: Path, rows: list[dict]) -> None:
    if "floor" not in args.skip:
        measure_floor(args, rows)
    server = start_worker(args, model_dir, 1, args.paced_step_seconds, log_dir)
    try:
        check_worker(args.port, model_dir.name, args.max_tokens)
        pids = {"frontend": server.frontend_pids, "engine": server.engine_pids}
        for interval in args.intervals:
            sent = None if interval == 1 and args.default_interval else interval
            request = raw_request(body(model_dir.name, args.max_tokens, sent), args.port)
            rows.append(record(f"frontend interval={interval}", load(args, request, 64, pids)))
        request = raw_request(body(model_dir.name, 1, None), args.port)
        rows.append(record("frontend max_tokens=1", load(args, request, 64, pids)))
    finally:
        server.stop()


def measure_engine(args: argparse.Namespace, model_dir: Path, log_dir: Path, rows: list[dict]) -> None:
    """The engine alone over 4 raw lanes (``engine_lanes``): the figure; then through a worker's
    4 HTTP frontends, where on a small machine the frontends set the pace (for the record)."""
    result = measure_engine_lanes(4, 512, args.max_tokens, args.warmup, args.duration)
    row = {"name": "engine lanes K=4 c=512", "requests": result.requests, "errors": 0,
           "requests_per_s": round(result.requests / result.window_s, 1), "frontend_ms": None,
           "engine_ms": round(result.engine_ms_per_request, 4), "events_per_request": None, "ttft_p50_ms": None,
           "engine_cores": round(result.engine_cpu_s / result.window_s, 2),
           "driver_ms": round(result.driver_cpu_s / max(result.requests, 1) * 1e3, 4),
           "outputs_per_request": round(result.outputs_per_request, 2),
           "outputs_per_message": round(result.outputs_per_message, 1)}
    print(f"  {row['name']:34} {row['requests_per_s']:8.1f} req/s  engine {row['engine_ms']:.4f} ms CPU/req "
          f"({row['engine_cores']} cores)  driver {row['driver_ms']:.4f} ms CPU/req  outputs/req "
          f"{row['outputs_per_request']}  outputs per lane message {row['outputs_per_message']}", flush=True)
    rows.append(row)
    if "http-engine" in args.skip:
        return
    server = start_worker(args, model_dir, 4, 0.0, log_dir)
    try:
        check_worker(args.port, model_dir.name, args.max_tokens)
        pids = {"frontend": server.frontend_pids, "engine": server.engine_pids}
        request = raw_request(body(model_dir.name, args.max_tokens, None), args.port)
        rows.append(record("engine via HTTP K=4 c=512", load(args, request, 512, pids)))
        rows[-1].update(engine_batches(args.port))
    finally:
        server.stop()


def engine_batches(port: int) -> dict:
    """The engine's batch through HTTP, from its per-step stats (``GET /metrics``: the last <= 10,000
    steps): the frontends, not the engine, set the pace there, so a step holds far fewer requests
    than over raw lanes, and what a step costs whatever its size (a poll, a message and a wake-up
    per lane) is shared by fewer requests."""
    connection = http.client.HTTPConnection(HOST, port, timeout=30)
    try:
        connection.request("GET", "/metrics")
        steps = json.loads(connection.getresponse().read())
    finally:
        connection.close()
    if not steps:
        return {}
    running = statistics.mean(s["num_running"] for s in steps)
    span = steps[-1]["timestamp"] - steps[0]["timestamp"]
    print(f"  {'':34} engine steps: {len(steps) / max(span, 1e-9):8.1f}/s, {running:.1f} requests running "
          f"per step (mean of the last {len(steps)})", flush=True)
    return {"engine_steps_per_s": round(len(steps) / max(span, 1e-9), 1), "engine_running_per_step": round(running, 1)}


def measure_bare(args: argparse.Namespace, model_dir: Path, log_dir: Path, rows: list[dict]) -> None:
    server = start_bare_app(args, "stream", log_dir)
    try:
        request = raw_request(body(model_dir.name, args.max_tokens, None), args.port)
        rows.append(record("bare-stream c=64", load(args, request, 64, {"frontend": [server.popen.pid]})))
    finally:
        server.stop()


def median(rows: list[dict], name: str, metric: str) -> float | None:
    values = [r[metric] for r in rows if r["name"] == name and r[metric] is not None]
    return statistics.median(values) if values else None


def target(name: str, value: float | None, limit: float, higher: bool = False, note: str = "") -> dict:
    passed = None if value is None else (value >= limit if higher else value <= limit)
    return {"name": name, "value": None if value is None else round(value, 4), "limit": limit,
            "passed": passed, "note": note}


def evaluate(args: argparse.Namespace, rows: list[dict]) -> tuple[list[dict], dict]:
    fe = median(rows, "frontend interval=1", "frontend_ms")
    events = median(rows, "frontend interval=1", "events_per_request")
    fe1 = median(rows, "frontend max_tokens=1", "frontend_ms")
    events1 = median(rows, "frontend max_tokens=1", "events_per_request")
    # Per event: between intervals 1 and the largest, the same tokens and the same request
    # lifetime, only the events differ; max_tokens=1 also shortens the request (fewer engine
    # steps, wake-ups and ACKs per request), so it is the fallback for a tree without intervals.
    per_event_us, per_event_note = None, ""
    top = max(args.intervals)
    fe_top = median(rows, f"frontend interval={top}", "frontend_ms")
    events_top = median(rows, f"frontend interval={top}", "events_per_request")
    if top > 1 and None not in (fe, fe_top, events, events_top) and events > events_top:
        per_event_us = (fe - fe_top) / (events - events_top) * 1e3
        per_event_note = f"interval 1 vs {top}: {fe} ms at {events} events vs {fe_top} ms at {events_top}; "
    if None not in (fe, fe1, events, events1) and events > events1:
        versus_one = (fe - fe1) / (events - events1) * 1e3
        per_event_us = versus_one if per_event_us is None else per_event_us
        per_event_note += f"16 vs 1 tokens: {versus_one:.1f} us ({fe1} ms at max_tokens=1)"
    floor = median(rows, "write floor", "write_floor_us")
    if per_event_us is not None and floor is not None:
        per_event_note += f"; the write floor {floor:.2f} us, the frontend's own {per_event_us - floor:.2f} us per event"
    engine = median(rows, "engine lanes K=4 c=512", "engine_ms")
    targets = [
        target("frontend CPU per streamed request, ms (K=1 c=64)", fe, FRONTEND_MS_TARGET,
               note=f"{events} events/request"),
        target("frontend CPU per SSE event beyond the first, us", per_event_us, EVENT_US_TARGET, note=per_event_note),
        target("engine CPU per request, ms (K=4 lanes c=512, zero step cost)", engine, ENGINE_MS_TARGET,
               note=f"through 4 HTTP frontends: {median(rows, 'engine via HTTP K=4 c=512', 'engine_ms')} ms"),
    ]
    capacity = {}
    if fe and engine:
        capacity = {"frontend_requests_per_core_s": round(1e3 / fe, 1),
                    "engine_requests_per_core_s": round(1e3 / engine, 1),
                    "engine_over_frontend": round(fe / engine, 2)}
        targets.append(target("capacity: engine ceiling / one frontend's", fe / engine, CAPACITY_TARGET, higher=True,
                              note=f"engine {capacity['engine_requests_per_core_s']} req/s per core, frontend "
                                   f"{capacity['frontend_requests_per_core_s']}: K={int(fe / engine)} frontends "
                                   f"before the engine binds"))
    cores = len(os.sched_getaffinity(0))
    if cores < SCALING_CORES:
        targets.append({"name": "K scaling: K=4 >= 3.2x K=1 req/s at c=512, TTFT p50 <= 0.35x", "value": None,
                        "limit": 3.2, "passed": None,
                        "note": f"needs >= {SCALING_CORES} cores (4 frontends, the engine, the load generator), "
                                f"have {cores}: run `benchmarks/frontend_scaling.py --num-frontends 1,4 "
                                f"--concurrency 512` there"})
    for interval in args.intervals:
        value = median(rows, f"frontend interval={interval}", "frontend_ms")
        targets.append({"name": f"frontend CPU per request at stream_interval={interval}, ms", "value": value,
                        "limit": None, "passed": None,
                        "note": f"{median(rows, f'frontend interval={interval}', 'events_per_request')} events/request"})
    return targets, capacity


def print_targets(targets: list[dict]) -> None:
    print("\ntargets")
    for t in targets:
        verdict = {True: "PASS", False: "FAIL", None: "    " if t["limit"] is None else "N/A "}[t["passed"]]
        value = "n/a" if t["value"] is None else f"{t['value']:g}"
        limit = "" if t["limit"] is None else f" (limit {t['limit']:g})"
        print(f"  {verdict} {t['name']}: {value}{limit}  {t['note']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--paced-step-seconds", type=float, default=0.01,
                        help="decode step of the frontend runs: every token its own SSE event")
    parser.add_argument("--intervals", type=lambda t: [int(x) for x in t.split(",")], default=[1, 4, 16])
    parser.add_argument("--default-interval", action="store_true",
                        help="interval 1 as the worker's default (no stream_interval in the body): a tree "
                             "without the field")
    parser.add_argument("--skip", type=lambda t: t.split(","), default=[], help="frontend, floor, engine, http-engine, bare")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "hot_paths.json"))
    args = parser.parse_args(argv)
    args.port = free_port() if args.port is None else args.port
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from workers.engine.model.tiny import make_tiny_model

    rows: list[dict] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hot-paths-") as tmp:
        make_tiny_model(Path(tmp) / "tiny-test", size="test")
        model_dir = Path(tmp) / "tiny-test"
        for repeat in range(args.repeats):
            print(f"repeat {repeat + 1}/{args.repeats}", flush=True)
            if "frontend" not in args.skip:
                measure_frontend(args, model_dir, Path(tmp), rows)
            if "engine" not in args.skip:
                measure_engine(args, model_dir, Path(tmp), rows)
            if "bare" not in args.skip:
                measure_bare(args, model_dir, Path(tmp), rows)
    targets, capacity = evaluate(args, rows)
    print_targets(targets)
    report = {"config": {**vars(args), "cores": len(os.sched_getaffinity(0))}, "runs": rows, "targets": targets,
              "capacity": capacity, "wall_s": round(time.monotonic() - started, 1)}
    write_report(report, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
