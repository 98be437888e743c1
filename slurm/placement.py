"""Which node(s) and GPUs each worker of each pool gets inside one allocation.

Nodes are indices into the job's node list (``scontrol show hostnames
$SLURM_JOB_NODELIST``), known only at run time; the rendered script maps
them to host names. Rules, in the order they are applied:

- A worker needs ``gpus_per_worker`` GPUs (default: its tensor-parallel size).
- A worker that needs more GPUs than a node has takes whole nodes
  (``gpus_per_worker`` must be a multiple of ``gpus_per_node``), its TP ranks
  spread evenly over them. These are placed first, from the last node down,
  so that they never wait behind fragments left by smaller workers.
- Every other worker stays on one node: first fit from node 0, GPUs
  numbered in order on the node (they become ``CUDA_VISIBLE_DEVICES``).
- Without GPUs (``gpus_per_node`` 0) workers are spread round-robin.
- Worker i of a pool listens on ``base_port + i``; pools' port ranges must not overlap.

A worker's TP ranks are the tasks of its one ``srun`` step: ``tasks_per_node``
on each of its nodes, rank 0 (the launcher and frontends) on the first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from common.config_errors import ConfigError

__all__ = [
    "PoolSpec", "WorkerPlacement", "PlacementError", "place_workers",
]


class PlacementError(ConfigError):
    """The pools do not fit the allocation; the message shows the arithmetic."""


@dataclass(frozen=True)
class PoolSpec:
    name: str
    """The pool's key in the deployment file (ctx, gen); workers are named <name>-<index>."""
    instances: int
    frontends: int
    """HTTP frontend processes per worker."""
    base_port: int
    """Worker i of the pool listens on base_port + i (all its frontends share it). Fixed before
    the job starts, so 0 (a free port chosen at start) is not allowed here."""
    tensor_parallel_size: int = 1
    gpus_per_worker: int | None = None
    """None: one GPU per TP rank when the nodes have GPUs, none otherwise."""

    def num_gpus(self, gpus_per_node: int) -> int:
        if self.gpus_per_worker is not None:
            return self.gpus_per_worker
        return self.tensor_parallel_size if gpus_per_node > 0 else 0

    def validate(self, prefix: str) -> None:
        if self.instances < 0:
            raise ConfigError(f"{prefix}.instances", f"must be >= 0, got {self.instances}")
        if self.frontends < 1:
            raise ConfigError(f"{prefix}.frontends", f"must be >= 1, got {self.frontends}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"{prefix}.tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}")
        if not 1 <= self.base_port <= 65535 - max(self.instances - 1, 0):
            raise ConfigError(f"{prefix}.base_port", f"{self.base_port} + {self.instances} workers leaves [1, 65535] "
                                                     f"(on Slurm ports are fixed before the job starts)")
        gpus = self.gpus_per_worker
        if gpus is not None and gpus < 0:
            raise ConfigError(f"{prefix}.gpus_per_worker", f"must be >= 0, got {gpus}")
        if gpus and gpus % self.tensor_parallel_size:
            raise ConfigError(f"{prefix}.gpus_per_worker", f"{gpus} GPUs do not split evenly over "
                                                           f"tensor_parallel_size {self.tensor_parallel_size}")


@dataclass(frozen=True)
class WorkerPlacement:
    pool: str
    index: int
    """Index within its pool."""
    nodes: tuple[int, ...]
    """Indices into the job's node list; more than one only for a worker wider than a node."""
    gpus: tuple[int, ...]
    """GPU indices on each of its nodes (CUDA_VISIBLE_DEVICES); empty for a CPU-only worker."""
    tasks_per_node: int
    """TP ranks on each node; rank 0 (on nodes[0]) is the launcher."""
    port: int
    frontends: int

    @property
    def name(self) -> str:
        return f"{self.pool}-{self.index}"

    @property
    def num_tasks(self) -> int:
        return self.tasks_per_node * len(self.nodes)


def place_workers(pools: Sequence[PoolSpec], nodes: int, gpus_per_node: int, prefix: str = "pools",
                  reserved_ports: Mapping[str, int] | None = None) -> tuple[WorkerPlacement, ...]:
    """Every worker of every pool, in pool order; raises PlacementError when they cannot fit.
    ``reserved_ports`` (key -> port, e.g. {"orchestrator.port": 8000}) must stay out of the pools' ranges."""
    for pool in pools:
        pool.validate(f"{prefix}.{pool.name}")
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ConfigError(prefix, f"pool names must be unique, got {names}")
    _check_ports(pools, prefix, reserved_ports or {})
    _check_total(pools, nodes, gpus_per_node)
    if gpus_per_node == 0:
        return _round_robin(pools, nodes)
    free = [gpus_per_node] * nodes  # free GPUs per node; a node's GPUs are handed out from index 0 up
    placed: dict[tuple[str, int], WorkerPlacement] = {}
    wide = [(p, i) for p in pools for i in range(p.instances) if p.num_gpus(gpus_per_node) > gpus_per_node]
    narrow = [(p, i) for p in pools for i in range(p.instances) if p.num_gpus(gpus_per_node) <= gpus_per_node]
    for pool, i in wide:
        placed[(pool.name, i)] = _place_wide(pool, i, free, gpus_per_node, f"{prefix}.{pool.name}")
    for pool, i in narrow:
        placed[(pool.name, i)] = _place_narrow(pool, i, free, gpus_per_node)
    return tuple(placed[(p.name, i)] for p in pools for i in range(p.instances))


def _check_ports(pools: Sequence[PoolSpec], prefix: str, reserved: Mapping[str, int]) -> None:
    for key, port in reserved.items():
        for pool in pools:
            if pool.base_port <= port < pool.base_port + pool.instances:
                raise ConfigError(key, f"port {port} is also {pool.name}-{port - pool.base_port}'s "
                                       f"(worker i listens on base_port + i)")
    for a_i, a in enumerate(pools):
        for b in pools[a_i + 1:]:
            if a.instances and b.instances and a.base_port < b.base_port + b.instances \
                    and b.base_port < a.base_port + a.instances:
                raise ConfigError(f"{prefix}.{b.name}.base_port",
                                  f"ports {b.base_port}..{b.base_port + b.instances - 1} overlap {a.name}'s "
                                  f"{a.base_port}..{a.base_port + a.instances - 1} (worker i listens on base_port + i)")


def _check_total(pools: Sequence[PoolSpec], nodes: int, gpus_per_node: int) -> None:
    terms = [f"{p.instances} {p.name} workers x {p.num_gpus(gpus_per_node)} GPUs" for p in pools]
    needed = sum(p.instances * p.num_gpus(gpus_per_node) for p in pools)
    have = nodes * gpus_per_node
    if needed > have:
        raise PlacementError("slurm.nodes", f"{' + '.join(terms)} = {needed} GPUs do not fit "
                                            f"{nodes} nodes x {gpus_per_node} GPUs per node = {have} GPUs")


def _round_robin(pools: Sequence[PoolSpec], nodes: int) -> tuple[WorkerPlacement, ...]:
    workers = [(p, i) for p in pools for i in range(p.instances)]
    return tuple(WorkerPlacement(pool=p.name, index=i, nodes=(k % nodes,), gpus=(),
                                 tasks_per_node=p.tensor_parallel_size, port=p.base_port + i,
                                 frontends=p.frontends)
                 for k, (p, i) in enumerate(workers))


def _place_wide(pool: PoolSpec, index: int, free: list[int], gpus_per_node: int, prefix: str) -> WorkerPlacement:
    gpus = pool.num_gpus(gpus_per_node)
    name = f"{pool.name}-{index}"
    if gpus % gpus_per_node:
        raise PlacementError(f"{prefix}.gpus_per_worker",
                             f"{name} needs {gpus} GPUs, more than a node's {gpus_per_node} but not whole nodes")
    span = gpus // gpus_per_node
    if pool.tensor_parallel_size % span:
        raise PlacementError(f"{prefix}.tensor_parallel_size",
                             f"{name}: {pool.tensor_parallel_size} TP ranks do not split evenly over {span} nodes")
    whole = [n for n in reversed(range(len(free))) if free[n] == gpus_per_node]
    if len(whole) < span:
        raise PlacementError("slurm.nodes", f"{name} needs {span} whole nodes of {gpus_per_node} GPUs; "
                                            f"only {len(whole)} are free (free GPUs per node: {free})")
    taken = tuple(sorted(whole[:span]))
    for n in taken:
        free[n] = 0
    return WorkerPlacement(pool=pool.name, index=index, nodes=taken, gpus=tuple(range(gpus_per_node)),
                           tasks_per_node=pool.tensor_parallel_size // span, port=pool.base_port + index,
                           frontends=pool.frontends)


def _place_narrow(pool: PoolSpec, index: int, free: list[int], gpus_per_node: int) -> WorkerPlacement:
    gpus = pool.num_gpus(gpus_per_node)
    name = f"{pool.name}-{index}"
    node = next((n for n, f in enumerate(free) if f >= gpus), None)
    if node is None:
        raise PlacementError("slurm.nodes", f"{name} needs {gpus} GPUs on one node; "
                                            f"free GPUs per node: {free}")
    first = gpus_per_node - free[node]
    free[node] -= gpus
    return WorkerPlacement(pool=pool.name, index=index, nodes=(node,), gpus=tuple(range(first, first + gpus)),
                           tasks_per_node=pool.tensor_parallel_size, port=pool.base_port + index,
                           frontends=pool.frontends)
