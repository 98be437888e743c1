"""The real workload on the local deployment (issue 17 item 9): sequential vs concurrency 4.

Brings up ``configs/local.yaml`` (SmolLM2-135M on the torch engine: a ctx worker, a gen worker,
a 2-process orchestrator) on free ports in a temporary run dir, then runs ``disagg bench``'s
library against it in one run: single-turn chat, streaming, 200-token prompts, 24 output tokens
(ignore_eos), first sequentially then at concurrency 4, 40 requests each after a warm-up, the
same workload as ``aiperf profile --endpoint-type chat --streaming --concurrency 4
--request-count 40 --isl 200 --osl 24``. Targets, against the sequential figures of the same run:

  * concurrency 4: ITL p50 <= 2x and TTFT p50 <= 2x sequential,
  * output tokens/s at concurrency 4 >= 3x sequential.

Prints the figures with PASS/FAIL lines and the load average (the machine is shared), and for each
level the CPU per request of every process (/proc), each engine's steps (busy share, mean decode
batch, prefill tokens per step) and the 2-core ceiling those CPU figures allow at c=4; writes JSON.

    python benchmarks/local_workload.py [--config configs/local.yaml] [--engine-threads auto|none|N]
        [--set KEY.PATH=VALUE ...] [--num-requests 40] [--aiperf PATH/TO/aiperf] [--out benchmarks/results/local_workload.json]

``--engine-threads`` sets the YAML's ``engine.threads`` (torch: leave each engine torch's default,
the behaviour before core partitioning, to measure the difference).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from frontend_scaling import children, cmdline
from http_loadgen import cpu_seconds

from disagg.bench import BenchPlan, WorkloadConfig, run_bench
from disagg.bench.api_clients import OpenAIChat
from disagg.bench.lengths import LengthDist
from disagg.bench.progress import PlainProgress
from disagg.bench.report import summary_lines


def set_keys(data: dict, settings: list[str]) -> None:
    """``--set`` overrides of a deployment's YAML: each ``KEY.PATH=VALUE``, the value read as YAML."""
    for setting in settings:
        path, _, value = setting.partition("=")
        *parents, leaf = path.split(".")
        node = data
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = yaml.safe_load(value)


def _deploy_config(source: Path, run_dir: Path, engine_threads: str, settings: list[str]) -> Path:
    data = yaml.safe_load(source.read_text())
    set_keys(data, settings)
    data["run_dir"] = str(run_dir)
    data["orchestrator"]["port"] = 0  # free ports: never collide with another deployment on the machine
    for pool in data["pools"].values():
        pool["base_port"] = 0
    if engine_threads != "default":
        value = engine_threads if engine_threads in ("auto", "torch") else int(engine_threads)
        data.setdefault("engine", {})["threads"] = value
    path = run_dir.parent / "local_workload.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _disagg(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disagg.cli", *argv], capture_output=True, text=True)


def _process_groups(state: dict) -> dict[str, list[int]]:
    """Every process of the deployment by role: each worker's engine (the launcher's child running
    ``workers.engine_proc``) and its frontends (the launcher and its attached frontends), and the
    orchestrator's processes (all of its tree)."""
    groups: dict[str, list[int]] = {}
    for process in state["processes"]:
        tree = _tree(process["pid"])
        if process["name"] == "orchestrator":
            groups["orchestrator"] = tree
            continue
        engines = [pid for pid in tree if "workers.engine_proc" in cmdline(pid)]
        groups[f"{process['name']} engine"] = engines
        groups[f"{process['name']} frontends"] = [pid for pid in tree if pid not in engines]
    return groups


def _worker_urls(state: dict) -> dict[str, str]:
    return {process["name"]: process["url"] for process in state["processes"] if process["name"] != "orchestrator"}


def _tree(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children(found[-1])
    return found


def _group_cpu(groups: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds (utime + stime, every thread) of each group, and of this process (the load generator)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {**{name: sum(cpu_seconds(pid) for pid in pids) for name, pids in groups.items()},
            "load generator": usage.ru_utime + usage.ru_stime}


# Where a disaggregated request's time to first token goes, from the orchestrator's /perf_metrics
# (its trace joined with both workers' perf records): name -> seconds of one record, None if unstamped.
_BREAKDOWN = {
    "ctx_leg": lambda r, c, g: r["ctx"]["end"] - r["ctx"]["start"],
    "ctx_queue": lambda r, c, g: c["first_scheduled"] - c["engine_arrival"],
    "ctx_prefill": lambda r, c, g: c["first_token"] - c["first_scheduled"],
    "gen_to_first_token": lambda r, c, g: g["first_token"] - r["gen"]["start"],
    "kv_transfer": lambda r, c, g: g.get("kv_transfer_seconds"),
    "gen_first_step": lambda r, c, g: g["first_token"] - g["first_scheduled"],
}


def _breakdown(url: str, since: float) -> dict[str, float]:
    """Median milliseconds of each ``_BREAKDOWN`` part over the disaggregated requests since ``since``."""
    import statistics

    import httpx

    time.sleep(0.5)  # workers ship perf records every 50 ms
    payload = httpx.get(f"{url}/perf_metrics", timeout=60).json()
    records = payload.get("records", payload.get("data", [])) if isinstance(payload, dict) else payload
    parts: dict[str, list[float]] = {name: [] for name in _BREAKDOWN}
    for record in records:
        ctx, gen = record.get("ctx_worker") or {}, record.get("gen_worker") or {}
        if not record.get("ctx") or not record.get("gen") or record["ctx"]["start"] < since:
            continue
        for name, part in _BREAKDOWN.items():
            try:
                value = part(record, ctx.get("record") or {}, gen.get("record") or {})
            except (KeyError, TypeError):
                continue
            if value is not None:
                parts[name].append(value)
    return {name: round(1e3 * statistics.median(values), 1) for name, values in parts.items() if values}


class _EngineCpu(PlainProgress):
    """Plain progress lines, every process's CPU seconds over each level (from /proc), what each
    engine's steps did (its worker's /metrics) and where the time to first token went (the
    orchestrator's perf records)."""

    def __init__(self, groups: dict[str, list[int]], url: str, workers: dict[str, str], worker_key: str) -> None:
        super().__init__(sys.stderr)
        self.groups, self.url, self.start, self.used, self.breakdowns = groups, url, {}, [], []
        self.workers, self.steps, self.walls = workers, [], []
        self.worker_headers = {"Authorization": f"Bearer {worker_key}"}  # every worker route needs it
        self.started = 0.0

    def start_level(self, label: str, total: int | None, duration: float | None) -> None:
        _engine_steps(self.workers, self.worker_headers, 1.0)  # drains what the steps before this level recorded
        self.start = _group_cpu(self.groups)
        self.started = time.time()
        super().start_level(label, total, duration)

    def end_level(self, summary) -> None:
        self.used.append({name: seconds - self.start[name] for name, seconds in _group_cpu(self.groups).items()})
        self.walls.append(time.time() - self.started)
        self.steps.append(_engine_steps(self.workers, self.worker_headers, self.walls[-1]))
        try:
            self.breakdowns.append(_breakdown(self.url, self.started))
        except Exception as exc:  # noqa: BLE001 - a diagnostic: the figures stand without it
            print(f"no TTFT breakdown: {exc}", file=sys.stderr)
            self.breakdowns.append({})
        super().end_level(summary)


def _engine_steps(workers: dict[str, str], headers: dict[str, str], wall: float) -> dict[str, dict[str, float]]:
    """Each engine's steps since the last drain of its worker's /metrics (launcher-owned: one complete
    drain per poll, and nothing else drains it in this deployment): how many, the share of ``wall``
    they took (busy), and the mean decode batch and prefill tokens of the steps that had any."""
    import httpx

    steps = {}
    for name, url in workers.items():
        try:
            stats = httpx.get(f"{url}/metrics", headers=headers, timeout=30).json()
        except (httpx.HTTPError, ValueError):
            continue
        decodes = [s["num_decode_tokens"] for s in stats if s["num_decode_tokens"]]
        prefills = [s["num_prefill_tokens"] for s in stats if s["num_prefill_tokens"]]
        steps[name] = {"steps": len(stats), "busy": sum(s["step_seconds"] for s in stats) / wall,
                       "decode_batch": sum(decodes) / len(decodes) if decodes else 0.0,
                       "prefill_tokens": sum(prefills) / len(prefills) if prefills else 0.0}
    return steps


def _measure(url: str, model: str, num_requests: int, groups: dict[str, list[int]], workers: dict[str, str],
             worker_key: str) -> list:
    """Sequential, then concurrency 4; each level draws prompts of its own (no level finds the
    previous one's prompts in the prefix cache)."""
    workload = WorkloadConfig(system_tokens=0, isl=LengthDist(200), osl=LengthDist(24), turns=LengthDist(1))
    plan = BenchPlan(url=url, api=OpenAIChat(model, ignore_eos=True), workload=workload, concurrencies=(1, 4),
                     num_requests=num_requests, warmup=4)
    progress = _EngineCpu(groups, url, workers, worker_key)
    levels, _ = asyncio.run(run_bench(plan, progress))
    runs = [level.summary.to_dict() for level in levels]
    for run, used, wall, steps, breakdown in zip(runs, progress.used, progress.walls, progress.steps,
                                                 progress.breakdowns):
        run["ttft_breakdown_p50_ms"] = breakdown
        run["engine_steps"] = steps
        tokens = run["output_tokens"]["mean"] * run["num_ok"] if run["num_ok"] else 0
        engines = {name: seconds for name, seconds in used.items() if name.endswith(" engine")}
        run["process_cpu_seconds"] = used
        run["cpu_ms_per_request"] = {name: 1e3 * seconds / run["num_ok"] for name, seconds in used.items()} \
            if run["num_ok"] else {}
        run["cpu_busy_cores"] = sum(used.values()) / wall  # of the machine's os.cpu_count()
        run["engine_cpu_seconds"] = engines
        run["engine_cpu_ms_per_output_token"] = 1e3 * sum(engines.values()) / tokens if tokens else None
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    parser.add_argument("--engine-threads", default="default", help="auto, torch or N (default: the file's)")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the config (dotted path, YAML value), e.g. "
                             "pools.ctx.engine.max_num_batched_tokens=256; repeatable")
    parser.add_argument("--aiperf", default=None, help="also run aiperf (this executable) at c=4: the cross-check")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/local_workload.json"))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still takes its deployment down
    with tempfile.TemporaryDirectory(prefix="disagg-lw-") as tmp:
        run_dir = Path(tmp) / "run"
        config = _deploy_config(args.config, run_dir, args.engine_threads, args.set)
        up = _disagg("up", str(config))
        if up.returncode != 0:
            print(f"disagg up failed:\n{up.stdout}\n{up.stderr}")
            return 1
        try:
            state = json.loads((run_dir / "state.json").read_text())
            model = yaml.safe_load(config.read_text())["model"]
            load_before = os.getloadavg()
            started = time.time()
            sequential, concurrent = _measure(state["url"], model, args.num_requests,
                                              _process_groups(state), _worker_urls(state),
                                              (run_dir / "worker.key").read_text())
            load_after, elapsed = os.getloadavg(), time.time() - started
            aiperf = _aiperf(args, state["url"], model, Path(tmp)) if args.aiperf else None
            threads = {p["name"]: p["argv"][p["argv"].index("--engine-threads") + 1]
                       for p in state["processes"] if "--engine-threads" in p["argv"]}
        finally:
            _disagg("down", "--run-dir", str(run_dir))
    if aiperf:
        print(f"aiperf at c=4 (cross-check): TTFT p50 {aiperf['ttft_p50_ms']:.1f} ms, ITL p50 {aiperf['itl_p50_ms']:.1f} "
              f"ms (disagg bench: TTFT p50 {concurrent['ttft']['p50'] * 1e3:.1f} ms, TPOT p50 "
              f"{concurrent['tpot']['p50'] * 1e3:.1f} ms), {aiperf['output_tokens_per_s']:.1f} output tok/s")
    return _report(args, sequential, concurrent, threads, load_before, load_after, elapsed, aiperf)


def _aiperf(args: argparse.Namespace, url: str, model: str, tmp: Path) -> dict:
    from aiperf_crosscheck import export_gguf_tokenizer, run_aiperf

    tokenizer = export_gguf_tokenizer(model, tmp / "tokenizer")
    options = argparse.Namespace(aiperf=args.aiperf, model=model, url=url, concurrency=4,
                                 request_count=args.num_requests, isl=200, osl=24, tokenizer=tokenizer)
    return run_aiperf(options, tmp / "aiperf")


def _report(args: argparse.Namespace, seq: dict, c4: dict, threads: dict, load_before: tuple, load_after: tuple,
            elapsed: float, aiperf: dict | None) -> int:
    print(f"engine threads per worker: {threads or 'torch default'}; cpus {os.cpu_count()}; load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after ({elapsed:.0f} s)")
    for run in (seq, c4):
        print("\n".join(summary_lines(run)))
        cpu = ", ".join(f"{name} {ms:.0f}" for name, ms in run["cpu_ms_per_request"].items())
        print(f"  CPU ms per request (/proc): {cpu}; {run['cpu_busy_cores'] or 0:.2f} cores busy; engines "
              f"{run['engine_cpu_ms_per_output_token'] or 0:.1f} ms per output token")
        steps = ", ".join(f"{name} {s['steps']} steps, busy {s['busy']:.0%}, decode batch {s['decode_batch']:.2f}, "
                          f"prefill {s['prefill_tokens']:.0f} tokens/step" for name, s in run["engine_steps"].items())
        print(f"  engine steps (workers' /metrics): {steps or 'none'}")
        parts = "  ".join(f"{name} {ms}" for name, ms in run["ttft_breakdown_p50_ms"].items())
        print(f"  TTFT parts, p50 ms (orchestrator /perf_metrics): {parts or 'none joined'}")
    ceiling = _ceiling(seq, c4, threads)
    print(f"  2-core ceiling at c=4 from this run's CPU per request: ctx engines {ceiling['ctx_req_per_s']:.2f} req/s "
          f"(one prefill at a time per engine thread), all processes {ceiling['cpu_req_per_s']:.2f} req/s "
          f"({os.cpu_count()} cores): output tok/s at most {ceiling['tok_s_ratio']:.2f}x sequential")
    targets = [
        ("c=4 ITL p50 <= 2x sequential", c4["itl"]["p50"] / seq["itl"]["p50"], 2.0, "<="),
        ("c=4 TTFT p50 <= 2x sequential", c4["ttft"]["p50"] / seq["ttft"]["p50"], 2.0, "<="),
        ("c=4 output tok/s >= 3x sequential", c4["output_tokens_per_s"] / seq["output_tokens_per_s"], 3.0, ">="),
    ]
    results = []
    for name, ratio, bound, op in targets:
        ok = ratio <= bound if op == "<=" else ratio >= bound
        results.append({"target": name, "ratio": ratio, "pass": ok})
        print(f"{'PASS' if ok else 'FAIL'}: {name}: {ratio:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": str(args.config), "engine_threads": threads,
                                    "load_average": {"before": load_before, "after": load_after},
                                    "cpus": os.cpu_count(), "sequential": seq, "concurrency_4": c4, "aiperf_c4": aiperf,
                                    "ceiling_c4": ceiling,
                                    "targets": results}, indent=1))
    print(f"wrote {args.out}")
    return 0 if all(r["pass"] for r in results) else 1


def _ceiling(seq: dict, c4: dict, threads: dict) -> dict:
    """The most requests/s this machine allows at the c=4 operating point, from the run's own CPU per
    request (/proc): a ctx engine prefills on its torch threads and no faster, and all processes
    together (load generator included) fit in the machine's cores. Over sequential requests/s, the
    bound on the output tok/s ratio (same output length). On a loaded machine CPU per request is
    inflated (caches, memory bandwidth), so read it from a quiet run."""
    per_request = c4["cpu_ms_per_request"]
    ctx_ms = sum(ms for name, ms in per_request.items() if name.startswith("ctx-") and name.endswith(" engine"))
    ctx_threads = sum(int(n) for name, n in threads.items() if name.startswith("ctx-") and str(n).isdigit()) or 1
    ctx_bound = 1e3 * ctx_threads / ctx_ms if ctx_ms else float("inf")
    cpu_bound = 1e3 * (os.cpu_count() or 1) / sum(per_request.values()) if per_request else float("inf")
    return {"ctx_req_per_s": ctx_bound, "cpu_req_per_s": cpu_bound,
            "tok_s_ratio": min(ctx_bound, cpu_bound) / seq["requests_per_s"] if seq["requests_per_s"] else 0.0}


if __name__ == "__main__":
    raise SystemExit(main())
