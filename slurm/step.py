"""``python -m slurm.step``: what the rendered sbatch script runs around each process.

    python -m slurm.step orchestrator --run-dir DIR --port P -- COMMAND...
        runs COMMAND (the orchestrator); once it answers HTTP on P, writes
        DIR/orchestrator.url = http://<this host>:P for the workers and `disagg up`
    python -m slurm.step worker --run-dir DIR -- COMMAND...
        waits for DIR/orchestrator.url, then becomes COMMAND (`disagg serve ...`) with
        ``--register-url URL --kv-advertise-host <this host> --advertise-url http://<this host>:<its
        --port>`` appended. In a step of several tasks (a worker's TP ranks) each task first finds
        its rank (slurm.ranks) and exports the DISAGG_TP_* variables; only rank 0 waits for the
        orchestrator and registers (it runs the launcher and the frontends), the other ranks
        become COMMAND at once (the engine follower) with only ``--kv-advertise-host``.

Torch-free, and light: every worker step imports it before exec.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

from slurm.ranks import discover_rank, rank_environ, write_rank_table
from slurm.rendezvous import publish_orchestrator_url, read_orchestrator_url

__all__ = ["main", "GPU_MASK_ENV"]
_POLL_SECONDS = 0.2
GPU_MASK_ENV = "DISAGG_GPU_MASK"
"""Set by the rendered script on a one-task worker step that shares its node (``slurm.plan._gpu_request``):
the bit mask of the step's GPUs (of those Slurm allotted it) the worker takes. Slurm applies
``--gpu-bind`` only to steps of several tasks."""


def _bind_gpus(mask: str) -> None:
    """Keep, of the GPUs Slurm gave this one-task step (CUDA_VISIBLE_DEVICES), those of ``mask``."""
    if os.environ.get("SLURMD_TRES_BIND"):  # Slurm bound the task itself
        return
    allotted = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    bits = int(mask, 16)
    kept = [gpu for index, gpu in enumerate(allotted) if gpu and bits >> index & 1]
    if len(kept) != bin(bits).count("1"):
        raise SystemExit(f"slurm.step: GPU mask {mask} is outside the step's GPUs {allotted}")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(kept)


def _answers(port: int) -> bool:
    """Whether the orchestrator serves: /health needs no API key, and answers 503 while no worker
    has registered yet (they wait for the URL this publishes)."""
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code in (200, 503)
    except httpx.HTTPError:
        return False


def _orchestrator(args: argparse.Namespace) -> int:
    child = subprocess.Popen(args.command)
    # scancel / the time limit signal every process of the step; a kill of this wrapper alone
    # (e.g. the batch script's forward_term) must still reach the orchestrator.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    while child.poll() is None and not _answers(args.port):
        time.sleep(_POLL_SECONDS)
    if child.poll() is None:
        url = f"http://{socket.gethostname()}:{args.port}"
        publish_orchestrator_url(Path(args.run_dir), url)
        print(f"slurm.step: the orchestrator answers; wrote {url} to {args.run_dir}", flush=True)
    return child.wait()


def _worker(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    host = socket.gethostname()  # what other nodes resolve; getfqdn() may answer localhost
    mask = os.environ.pop(GPU_MASK_ENV, None)
    if mask is not None:
        _bind_gpus(mask)
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        rank = discover_rank(run_dir)
        os.environ.update(rank_environ(rank))
        print(f"slurm.step: rank {rank.rank} of {rank.world_size} (local rank {rank.local_rank}) on "
              f"{os.environ.get('SLURMD_NODENAME', host)}, rank 0 at {rank.master_addr}:{rank.master_port} "
              f"(found through {rank.via})", flush=True)
        if rank.rank > 0:
            _exec([*args.command, "--kv-advertise-host", host])
        write_rank_table(run_dir, os.environ.get("SLURM_JOB_NAME", "worker"), rank)
    while (url := read_orchestrator_url(run_dir)) is None:
        time.sleep(_POLL_SECONDS)  # the job's time limit bounds this wait
    command = [*args.command, "--register-url", url, "--kv-advertise-host", host]
    if "--port" in args.command:
        command += ["--advertise-url", f"http://{host}:{args.command[args.command.index('--port') + 1]}"]
    _exec(command)


def _exec(command: list[str]) -> NoReturn:
    sys.stdout.flush()
    os.execvp(command[0], command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurm.step")
    sub = parser.add_subparsers(dest="role", required=True)
    orch = sub.add_parser("orchestrator")
    orch.add_argument("--run-dir", required=True)
    orch.add_argument("--port", type=int, required=True)
    orch.add_argument("command", nargs=argparse.REMAINDER)
    orch.set_defaults(func=_orchestrator)
    worker = sub.add_parser("worker")
    worker.add_argument("--run-dir", required=True)
    worker.add_argument("command", nargs=argparse.REMAINDER)
    worker.set_defaults(func=_worker)
    args = parser.parse_args(argv)
    if hasattr(args, "command"):
        args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not args.command:
            parser.error("a command after -- is required")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
