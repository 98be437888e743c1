"""Plans the render tests and the cluster tests share: a laptop-like and the dsv4 topology."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from slurm.config import ContainerConfig, SlurmConfig
from slurm.placement import PoolSpec, WorkerPlacement, place_workers
from slurm.plan import RUN_DIR, JobPlan, build_plan

WorkerArgv = Callable[[WorkerPlacement], Sequence[str]]


def serve_argv(model_dir: str) -> WorkerArgv:
    def argv(worker: WorkerPlacement) -> list[str]:
        return ["disagg", "serve", model_dir, "--engine", "synthetic", "--role", worker.pool, "--host", "0.0.0.0",
                "--port", str(worker.port), "--num-frontends", str(worker.frontends)]
    return argv


ORCHESTRATOR_ARGV = ("disagg", "orchestrator", "--config", f"{RUN_DIR}/orchestrator.json")
TINY_WORKER_ARGV = serve_argv(".cache/tiny-test")


def local_plan(slurm: SlurmConfig | None = None, gen_tp: int = 1,
               orchestrator_argv: Sequence[str] = ORCHESTRATOR_ARGV,
               worker_argv: WorkerArgv = TINY_WORKER_ARGV) -> JobPlan:
    """One CPU node: the orchestrator, 1 ctx and 1 gen worker with 2 frontends each."""
    slurm = slurm or SlurmConfig(nodes=1, cpus_per_node=8, job_name="disagg-local", time_limit="30",
                                 env_setup="source .venv/bin/activate")
    pools = (PoolSpec("ctx", 1, 2, 8100), PoolSpec("gen", 1, 2, 8200, tensor_parallel_size=gen_tp))
    workers = place_workers(pools, slurm.nodes, slurm.gpus_per_node)
    return build_plan(slurm, workers, orchestrator_argv, worker_argv, "disagg deployment: local-like test plan")


def dsv4_plan() -> JobPlan:
    """11 ctx workers of 4 GPUs (8 frontends), 1 gen worker of 16 GPUs (4 frontends), 4-GPU nodes."""
    slurm = SlurmConfig(partition="batch", account="llm-serving", qos="high", time_limit="04:00:00", nodes=15,
                        gpus_per_node=4, mem="0", job_name="dsv4",
                        env_setup="module load cuda/12.4\nexport HF_HUB_OFFLINE=1",
                        container=ContainerConfig(image="nvcr.io#nvidia/pytorch:24.05-py3",
                                                  mounts=("/shared:/shared", "/models:/models:ro")),
                        extra_sbatch=("--reservation=serving",), run_root="/shared/disagg-runs")
    pools = (PoolSpec("ctx", 11, 8, 8100, tensor_parallel_size=4), PoolSpec("gen", 1, 4, 8200, tensor_parallel_size=16))
    workers = place_workers(pools, slurm.nodes, slurm.gpus_per_node)
    return build_plan(slurm, workers, ORCHESTRATOR_ARGV, serve_argv("/models/DeepSeek-V4-Pro"),
                      "disagg deployment: configs/dsv4.yaml (dsv4-like test plan)")


def narrow_plan(worker_argv: WorkerArgv = TINY_WORKER_ARGV, slurm: SlurmConfig | None = None,
                orchestrator_argv: Sequence[str] = ORCHESTRATOR_ARGV) -> JobPlan:
    """Workers narrower than a node, two per node of 4 GPUs: 2 ctx workers of 2 TP ranks (a GPU each)
    on node 0 beside the orchestrator, 2 single-process gen workers of 1 GPU on node 1."""
    slurm = slurm or SlurmConfig(nodes=2, gpus_per_node=4, job_name="narrow", time_limit="5")
    pools = (PoolSpec("ctx", 2, 1, 8100, tensor_parallel_size=2), PoolSpec("gen", 2, 1, 8200))
    workers = place_workers(pools, slurm.nodes, slurm.gpus_per_node)
    return build_plan(slurm, workers, orchestrator_argv, worker_argv, "disagg deployment: narrow workers")
