"""configs/dsv4-synthetic.yaml (the published TP layout, synthetic engines) for real on this machine: the emulated 15-node, 4-GPU-per-node Slurm cluster.

What it does, in order, and what it measures:

1. ``slurm/dev_cluster.sh up --nodes 15 --gpus-per-node 4`` (as root; a no-op when it is up).
2. ``disagg up configs/dsv4-synthetic.yaml --launcher slurm``: one job, the orchestrator and 12 worker steps
   (11 ctx workers of TP 4 with 8 frontends, 1 gen worker of TP 16 over 4 nodes with 4
   frontends), synthetic engines on the dsv4 timing model. START-UP TIME: from the command to
   "ready" (the orchestrator reports every registered worker healthy).
3. The orchestrator's /cluster_info must list 11 ctx and 1 gen workers, all healthy; every TP
   step's ranks must run on the planned nodes (``disagg status`` prints them).
4. TOTAL MEMORY of the deployment: RSS summed over every process of the job (everything below
   the job's slurmstepds) and PSS (shared pages counted once), from /proc.
5. ``--requests`` chat completions (default 500) through the official ``openai`` client,
   ``--concurrency`` at a time: REQUESTS/S, and every one must finish with ``--max-tokens`` tokens.
6. ``disagg down``: the queue is empty and no process of the deployment is left.

Prints the figures, PASS/FAIL for the acceptance checks, and writes JSON (``--out``). Not part of
CI. Measured on the 2-core, 24 GB machine (busy with other work) with the engine's TP ranks: the
whole run 88 s; start-up 59.1 s; 186 processes, RSS 8.4 GiB, PSS 4.8 GiB; 500 requests of 16
tokens at concurrency 32 in 11.2 s = 44.7 requests/s; `disagg down` 13.7 s.

    sudo python benchmarks/dsv4_emulated.py [--config configs/dsv4-synthetic.yaml] [--requests 500]
        [--concurrency 32] [--max-tokens 16] [--out benchmarks/results/dsv4_emulated.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

REPO = Path(__file__).resolve().parents[1]
EMULATED_CONF = "/tmp/disagg-slurm-emu/slurm.conf"


def _env() -> dict[str, str]:
    # The job inherits this environment (sbatch --export=ALL): this interpreter's venv first on PATH.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PATH": path, "PYTHONPATH": pythonpath, "SLURM_CONF": EMULATED_CONF}


def _disagg(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "disagg.cli", *args], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(proc.name))
    return tree


def _cmdline(pid: int) -> str:
    try:
        return (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    except OSError:
        return ""


def job_processes(job_id: int) -> list[int]:
    """Every process below the job's slurmstepds (the batch script, every step's tasks and their children)."""
    tree = _children()
    roots = [pid for pids in tree.values() for pid in pids if _cmdline(pid).startswith(f"slurmstepd: [{job_id}.")]
    found: list[int] = []
    stack = [child for root in roots for child in tree.get(root, [])]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(tree.get(pid, []))
    return found


def memory_kib(pids: list[int]) -> tuple[int, int]:
    """(RSS, PSS) summed over ``pids``, in KiB."""
    rss = pss = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except OSError:
            continue
    return rss, pss


def run_requests(url: str, model: str, requests: int, concurrency: int, max_tokens: int) -> tuple[float, int]:
    """(seconds, requests that finished with max_tokens tokens)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)

    def one(i: int) -> bool:
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Request {i}: summarize the plan in one line."}],
            max_tokens=max_tokens, extra_body={"ignore_eos": True})
        return chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == max_tokens

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        done = sum(pool.map(one, range(requests)))
    return time.perf_counter() - start, done


def check(results: dict[str, bool], name: str, ok: bool, detail: str = "") -> None:
    results[name] = ok
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/dsv4-synthetic.yaml")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--nodes", type=int, default=15)
    parser.add_argument("--gpus-per-node", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "dsv4_emulated.json")
    args = parser.parse_args()
    bench_start = time.perf_counter()
    up_cluster = subprocess.run([str(REPO / "slurm" / "dev_cluster.sh"), "up", "--nodes", str(args.nodes),
                                 "--gpus-per-node", str(args.gpus_per_node)], capture_output=True, text=True)
    if up_cluster.returncode != 0:
        print(up_cluster.stderr, file=sys.stderr)
        return 1
    run_dir = Path(f"/tmp/dsv4-emulated-{os.getpid()}")
    results: dict[str, bool] = {}
    figures: dict[str, float] = {}
    start = time.perf_counter()
    up = _disagg("up", args.config, "--launcher", "slurm", "--run-dir", str(run_dir), timeout=1800)
    figures["startup_seconds"] = time.perf_counter() - start
    print(up.stdout[-2000:], up.stderr[-4000:], sep="\n", flush=True)
    try:
        check(results, "up", up.returncode == 0, f"{figures['startup_seconds']:.1f} s to ready")
        if up.returncode != 0:
            return 1
        job_id = json.loads((run_dir / "slurm.json").read_text())["job_id"]
        url = f"http://{socket.gethostname()}:{json.loads((run_dir / 'slurm.json').read_text())['orchestrator_port']}"
        workers = httpx.get(f"{url}/cluster_info", timeout=10).json()["workers"]
        roles = sorted(w.get("role", "?") for w in workers if w["healthy"])
        check(results, "11 ctx + 1 gen healthy", roles.count("ctx") == 11 and roles.count("gen") == 1,
              f"healthy roles {roles}")
        status = _disagg("status", "--run-dir", str(run_dir), timeout=60)
        print(status.stdout, flush=True)
        rank_lines = [line.strip() for line in status.stdout.splitlines() if " rank" in line and " on " in line
                      and line.startswith(" " * 17)]
        planned = [f"4 ranks on n{i}: n{i} 0-3; " for i in range(11)]  # ctx-i on node i, gen-0 on the last 4
        planned.append("16 ranks on n[11-14]: n11 0-3, n12 4-7, n13 8-11, n14 12-15; ")
        check(results, "status shows every worker's ranks on its planned nodes",
              status.returncode == 0 and len(rank_lines) == 12
              and all(line.startswith(plan) for line, plan in zip(rank_lines, planned)),
              f"{len(rank_lines)} rank lines")
        pids = job_processes(job_id)
        rss, pss = memory_kib(pids)
        figures.update(processes=len(pids), rss_mib=rss / 1024, pss_mib=pss / 1024)
        print(f"deployment: {len(pids)} processes, RSS {rss / 1024:.0f} MiB, PSS {pss / 1024:.0f} MiB", flush=True)
        model = openai.OpenAI(base_url=f"{url}/v1", api_key="unused").models.list().data[0].id
        seconds, done = run_requests(url, model, args.requests, args.concurrency, args.max_tokens)
        figures.update(requests=args.requests, requests_per_second=args.requests / seconds,
                       request_seconds=seconds)
        check(results, f"{args.requests} requests complete", done == args.requests,
              f"{done} complete in {seconds:.1f} s = {args.requests / seconds:.1f} requests/s "
              f"(concurrency {args.concurrency}, {args.max_tokens} tokens each)")
    finally:
        start = time.perf_counter()
        down = _disagg("down", "--run-dir", str(run_dir), timeout=300)
        figures["down_seconds"] = time.perf_counter() - start
        queue = subprocess.run(["squeue", "-h", "-o", "%i"], env=_env(), capture_output=True, text=True).stdout
        left = [pid for pids in _children().values() for pid in pids if str(run_dir) in _cmdline(pid)]
        check(results, "down leaves an empty queue and no process",
              down.returncode == 0 and not queue.strip() and not left,
              f"{figures['down_seconds']:.1f} s; queue {queue.split()}, {len(left)} processes left")
    figures["total_seconds"] = time.perf_counter() - bench_start
    print(f"startup {figures['startup_seconds']:.1f} s, RSS {figures.get('rss_mib', 0):.0f} MiB "
          f"(PSS {figures.get('pss_mib', 0):.0f} MiB) in {figures.get('processes', 0):.0f} processes, "
          f"{figures.get('requests_per_second', 0):.1f} requests/s; whole run {figures['total_seconds']:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": args.config, "figures": figures, "checks": results}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
