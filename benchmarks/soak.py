"""Memory soak: does any process of a disaggregated deployment grow under a long steady load?

One ctx worker and one gen worker (the random-weight tiny ``bench`` Llama on the
torch engine, a KV pool small enough to be fully touched within the first
minutes) behind a one-process orchestrator, all started by ``disagg up``;
conditional disaggregation off, so every request takes both legs (prefill and
KV parking on the ctx engine, a KV pull on the gen engine). ``--requests``
streamed chat completions (distinct prompts of 40-400 words, 16-48 output
tokens, ``ignore_eos``) at concurrency ``--concurrency``; a share
``--disconnect-share`` of the clients go away after their first event (the
request is aborted at every hop: the orchestrator, the gen worker, its engine,
and, when it comes early, the ctx leg).

Every ``--sample-seconds`` the VmRSS of every process of the deployment (each
worker's launcher, attached frontends, engine, and the orchestrator's
processes) is read from /proc. After the warm-up (``--warmup-share`` of the
requests: the KV pool, the prefix cache, the allocator's arenas and the
interpreter's caches have reached their working size), the least-squares slope
of each process's RSS against time is printed in MB/min against the target
(<= 1 MB/min), and everything goes to ``--out`` as JSON.

    python benchmarks/soak.py [--requests 5000] [--concurrency 32] [--disconnect-share 0.1]
        [--sample-seconds 10] [--out benchmarks/results/soak.json] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontend_scaling import children, cmdline, rss_mb
from local_workload import set_keys

TARGET_MB_PER_MIN = 1.0
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()

DEPLOYMENT = {
    "model": "tiny",
    "tiny_model_size": "bench",
    "engine": {"kind": "torch", "dtype": "float32", "device": "cpu", "threads": "auto", "block_size": 16,
               "num_blocks": 512, "max_num_seqs": 32, "max_num_batched_tokens": 1024, "kv_park_seconds": 30},
    "orchestrator": {"host": "127.0.0.1", "port": 0, "processes": 1, "conditional": {"enabled": False},
                     "timeouts": {"request_seconds": 300.0}},
    "pools": {"ctx": {"instances": 1, "frontends": 1, "base_port": 0},
              "gen": {"instances": 1, "frontends": 1, "base_port": 0}},
}


def deployment(run_dir: Path, settings: list[str]) -> Path:
    data = json.loads(json.dumps(DEPLOYMENT))
    set_keys(data, settings)
    data["run_dir"] = str(run_dir)
    path = run_dir.parent / "soak.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def disagg(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disagg.cli", *argv], capture_output=True, text=True)


def processes(state: dict) -> dict[str, int]:
    """Every process of the deployment by a stable name: ``<worker> launcher|frontend N|engine``,
    ``orchestrator N``."""
    named: dict[str, int] = {}
    for process in state["processes"]:
        found, todo = [], [process["pid"]]
        while todo:
            found.append(todo.pop())
            todo += children(found[-1])
        frontends = 0
        for pid in sorted(found):
            line = cmdline(pid)
            if process["name"] == "orchestrator":
                named[f"orchestrator {len([n for n in named if n.startswith('orchestrator')])}"] = pid
            elif "workers.engine_proc" in line:
                named[f"{process['name']} engine"] = pid
            elif pid == process["pid"]:
                named[f"{process['name']} launcher"] = pid
            elif "python" in line:
                frontends += 1
                named[f"{process['name']} frontend {frontends}"] = pid
    return named


class Sampler(threading.Thread):
    """VmRSS of every process every ``period`` seconds, with the requests done at that moment."""

    def __init__(self, pids: dict[str, int], period: float, progress: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.pids, self.period, self.progress = pids, period, progress
        self.samples: list[dict] = []
        self.stop = threading.Event()

    def sample(self) -> None:
        self.samples.append({"t": time.time(), "done": self.progress["done"],
                             "rss_mb": {name: rss_mb(pid) for name, pid in self.pids.items()}})

    def run(self) -> None:
        while not self.stop.wait(self.period):
            self.sample()


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 400)))


def error_code(body: bytes) -> str:
    """The ``code`` (else ``type``) of an OpenAI-shaped error body; ``?`` for any other body."""
    try:
        error = json.loads(body)["error"]
        return str(error.get("code") or error.get("type"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return "?"


async def one_request(http: httpx.AsyncClient, url: str, model: str, rng: random.Random, disconnect: bool) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": prompt(rng)}], "stream": True,
            "max_tokens": rng.randint(16, 48), "ignore_eos": True}
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:  # named by the API's error code: a refusal is not a failure
            return f"http {response.status_code} {error_code(await response.aread())}"
        async for line in response.aiter_lines():
            if disconnect and line.startswith("data:"):
                return "disconnected"  # leaving the block closes the connection mid-stream
            if line.startswith("data: [DONE]"):
                return "ok"
    return "cut"


async def load(url: str, model: str, args: argparse.Namespace, progress: dict[str, int]) -> dict[str, int]:
    outcomes: dict[str, int] = {}
    rng = random.Random(args.seed)
    next_index = iter(range(args.requests))
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as http:
        async def client() -> None:
            for _ in next_index:
                try:
                    outcome = await one_request(http, url, model, rng, rng.random() < args.disconnect_share)
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                progress["done"] += 1
                if progress["done"] % 250 == 0:
                    print(f"  {progress['done']} requests ({outcomes})", flush=True)

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
    return outcomes


def slope_mb_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) points, in MB per minute."""
    if len(points) < 3:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_m = sum(m for _, m in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60 * sum((t - mean_t) * (m - mean_m) for t, m in points) / var


def report(samples: list[dict], warmup_done: int) -> dict[str, dict]:
    names = sorted({name for s in samples for name in s["rss_mb"]})
    start = samples[0]["t"]
    after = [s for s in samples if s["done"] >= warmup_done]
    figures = {}
    for name in names:
        points = [(s["t"] - start, s["rss_mb"][name]) for s in after if s["rss_mb"].get(name) is not None]
        series = [s["rss_mb"].get(name) for s in samples]
        known = [m for m in series if m is not None]
        slope = slope_mb_per_min(points)
        figures[name] = {"first_mb": known[0] if known else None, "warm_mb": points[0][1] if points else None,
                         "last_mb": known[-1] if known else None, "max_mb": max(known) if known else None,
                         "slope_mb_per_min": slope,
                         "pass": slope is not None and slope <= TARGET_MB_PER_MIN}
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--disconnect-share", type=float, default=0.1)
    parser.add_argument("--sample-seconds", type=float, default=10.0)
    parser.add_argument("--warmup-share", type=float, default=0.3,
                        help="the slope is fitted over the samples after this share of the requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the deployment (dotted path, YAML value); repeatable")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/soak.json"))
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still takes its deployment down
    with tempfile.TemporaryDirectory(prefix="disagg-soak-") as tmp:
        run_dir = Path(tmp) / "run"
        config = deployment(run_dir, args.set)
        up = disagg("up", str(config))
        if up.returncode != 0:
            print(f"disagg up failed:\n{up.stdout}\n{up.stderr}")
            return 1
        try:
            state = json.loads((run_dir / "state.json").read_text())
            pids = processes(state)
            print(f"soak: {args.requests} requests at c={args.concurrency}, {args.disconnect_share:.0%} "
                  f"disconnects; sampling {len(pids)} processes every {args.sample_seconds:g} s", flush=True)
            progress = {"done": 0}
            sampler = Sampler(pids, args.sample_seconds, progress)
            sampler.sample()
            sampler.start()
            started = time.time()
            model = yaml.safe_load(config.read_text())["model"]  # served under its name as written
            outcomes = asyncio.run(load(state["url"], model, args, progress))
            elapsed = time.time() - started
            sampler.stop.set()
            sampler.join()
            sampler.sample()
        finally:
            disagg("down", "--run-dir", str(run_dir))
    figures = report(sampler.samples, int(args.warmup_share * args.requests))
    print(f"{args.requests} requests in {elapsed:.0f} s ({args.requests / elapsed:.1f}/s): {outcomes}")
    print(f"RSS slope after the first {args.warmup_share:.0%} of the requests (target <= {TARGET_MB_PER_MIN:g} MB/min):")
    for name, figure in figures.items():
        slope = figure["slope_mb_per_min"]
        shown = "n/a" if slope is None else f"{slope:+.2f} MB/min"
        print(f"  {name:24s} {figure['first_mb']:8.1f} -> {figure['warm_mb'] or 0:8.1f} -> {figure['last_mb']:8.1f} MB"
              f"  slope {shown:>14s}  {'PASS' if figure['pass'] else 'FAIL'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                                    "elapsed_seconds": elapsed, "outcomes": outcomes, "processes": figures,
                                    "samples": sampler.samples}, indent=1))
    print(f"wrote {args.out}")
    return 0 if all(f["pass"] for f in figures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
