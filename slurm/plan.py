"""What one Slurm job runs: the job's resources and its steps, before any shell is written.

``slurm.render`` turns a ``JobPlan`` into an sbatch script; ``disagg up`` and
``disagg render`` build the plan from the deployment file (the pools give
``PoolSpec``s, ``place_workers`` gives the nodes, the deployment gives the
commands). A command may contain ``{run_dir}``: the job's run directory on
the shared filesystem, known only once the job has an id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.config_errors import ConfigError
from slurm.config import SlurmConfig
from slurm.placement import WorkerPlacement
from slurm.step import GPU_MASK_ENV

__all__ = ["Step", "JobPlan", "build_plan", "RUN_DIR", "ORCHESTRATOR_STEP"]

RUN_DIR = "{run_dir}"
"""Placeholder for the run directory inside step commands and environment values."""
ORCHESTRATOR_STEP = "orchestrator"


@dataclass(frozen=True)
class Step:
    """One ``srun`` inside the allocation; every step runs concurrently with the others."""

    name: str
    """Unique in the job; also its log file: <run dir>/logs/<name>.log."""
    argv: tuple[str, ...]
    nodes: tuple[int, ...]
    """Indices into the job's node list."""
    tasks_per_node: int = 1
    """More than one task in all: an MPI (PMIx) world whose rank 0 is the launcher."""
    env: tuple[tuple[str, str], ...] = ()
    """Set for this step only."""
    gpus_per_node: int = 0
    """GPUs the step asks Slurm for on each of its nodes (``--gres=gpu:N``); Slurm sets the
    tasks' CUDA_VISIBLE_DEVICES."""
    gpu_bind: str | None = None
    """``--gpu-bind``: which of those each task gets, when not all of them (``_gpu_request``)."""
    summary: str = ""
    """One line for the comment above the step."""

    @property
    def num_tasks(self) -> int:
        return self.tasks_per_node * len(self.nodes)


@dataclass(frozen=True)
class JobPlan:
    slurm: SlurmConfig
    steps: tuple[Step, ...]
    title: str
    """First comment line of the script, e.g. where the deployment came from."""
    setup: tuple[tuple[str, ...], ...] = ()
    """Commands the batch shell runs once, in order, before any step (e.g. writing the
    orchestrator's config into the run directory); ``{run_dir}`` allowed."""

    def __post_init__(self) -> None:
        names = [s.name for s in self.steps]
        if len(set(names)) != len(names):
            raise ConfigError("steps", f"step names must be unique, got {names}")
        for step in self.steps:
            if not step.argv:
                raise ConfigError(f"steps.{step.name}", "has an empty command")
            if not step.nodes or min(step.nodes) < 0 or max(step.nodes) >= self.slurm.nodes:
                raise ConfigError(f"steps.{step.name}",
                                  f"nodes {list(step.nodes)} outside the job's {self.slurm.nodes} nodes")
            if step.tasks_per_node < 1:
                raise ConfigError(f"steps.{step.name}", f"tasks_per_node must be >= 1, got {step.tasks_per_node}")


def build_plan(slurm: SlurmConfig, workers: Sequence[WorkerPlacement], orchestrator_argv: Sequence[str],
               worker_argv: Callable[[WorkerPlacement], Sequence[str]], title: str,
               setup: Sequence[Sequence[str]] = ()) -> JobPlan:
    """The orchestrator on node 0, then one step per placed worker."""
    steps = [Step(name=ORCHESTRATOR_STEP, argv=tuple(orchestrator_argv), nodes=(0,),
                  summary="the one URL clients use; workers register with it through the run directory")]
    for worker in workers:
        gpus, bind, env = _gpu_request(worker)
        steps.append(Step(name=worker.name, argv=tuple(worker_argv(worker)), nodes=worker.nodes,
                          tasks_per_node=worker.tasks_per_node, env=env, gpus_per_node=gpus, gpu_bind=bind,
                          summary=_worker_summary(worker)))
    return JobPlan(slurm=slurm, steps=tuple(steps), title=title, setup=tuple(tuple(c) for c in setup))


def _gpu_request(worker: WorkerPlacement) -> tuple[int, str | None, tuple[tuple[str, str], ...]]:
    """(``--gres=gpu:N``, ``--gpu-bind``, step environment) that give ``worker`` its planned GPUs.

    A worker whose GPUs are its nodes' first N asks for N and every task sees all of them (a TP
    rank takes the one of its local rank). A worker that shares its node with another (its GPUs
    do not start at 0) cannot just ask for its count: steps run with ``--overlap``, which shares
    GRES too, so Slurm would hand both workers the node's first GPUs. It asks for the GPUs up to
    its highest and binds each task to its own (``map_gpu``: one per task; ``mask_gpu``: several).
    Slurm (22.05) binds only steps of several tasks: for a one-task step ``slurm.step`` applies
    the same mask itself (``GPU_MASK_ENV``), within the GPUs Slurm gave the step.
    """
    if not worker.gpus:
        return 0, None, ()
    count = max(worker.gpus) + 1
    if worker.gpus == tuple(range(count)):
        return count, None, ()
    if worker.tasks_per_node == 1:
        mask = _mask(worker.gpus)
        return count, f"mask_gpu:{mask}", ((GPU_MASK_ENV, mask),)
    per_task = len(worker.gpus) // worker.tasks_per_node
    groups = [worker.gpus[i * per_task:(i + 1) * per_task] for i in range(worker.tasks_per_node)]
    if per_task == 1:
        return count, "map_gpu:" + ",".join(str(g) for (g,) in groups), ()
    return count, "mask_gpu:" + ",".join(_mask(group) for group in groups), ()


def _mask(gpus: Sequence[int]) -> str:
    return hex(sum(1 << gpu for gpu in gpus))


def _worker_summary(worker: WorkerPlacement) -> str:
    where = f"node {worker.nodes[0]}" if len(worker.nodes) == 1 else f"nodes {_span(worker.nodes)}"
    gpus = f", GPUs {_span(worker.gpus)}" if worker.gpus else ""
    ranks = f", {worker.num_tasks} TP ranks (rank 0 is the launcher)" if worker.num_tasks > 1 else ""
    return f"{worker.pool} worker on {where}{gpus}{ranks}, port {worker.port}, {worker.frontends} frontends"


def _span(ids: tuple[int, ...]) -> str:
    contiguous = list(ids) == list(range(ids[0], ids[0] + len(ids)))
    if len(ids) > 1 and contiguous:
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))
