from __future__ import annotations

import pytest

from slurm.placement import (
    PlacementError,
    PoolSpec,
    WorkerPlacement,
    place_workers,
)
from workers.config import ConfigError

DSV4_POOLS = (PoolSpec("ctx", 11, 8, 8100, tensor_parallel_size=4),
              PoolSpec("gen", 1, 4, 8200, tensor_parallel_size=16))


def test_dsv4_fills_fifteen_four_gpu_nodes() -> None:
    workers = place_workers(DSV4_POOLS, nodes=15, gpus_per_node=4)
    assert [w.name for w in workers] == [f"ctx-{i}" for i in range(11)] + ["gen-0"]
    for i, w in enumerate(workers[:11]):
        assert w == WorkerPlacement(pool="ctx", index=i, nodes=(i,), gpus=(0, 1, 2, 3), tasks_per_node=4,
                                    port=8100 + i, frontends=8)
    # The 16-GPU worker takes four whole nodes, from the end, 4 ranks on each.
    assert workers[11] == WorkerPlacement(pool="gen", index=0, nodes=(11, 12, 13, 14), gpus=(0, 1, 2, 3),
                                          tasks_per_node=4, port=8200, frontends=4)
    assert workers[11].num_tasks == 16


def test_too_few_nodes_is_refused_with_the_arithmetic() -> None:
    with pytest.raises(PlacementError) as info:
        place_workers(DSV4_POOLS, nodes=14, gpus_per_node=4)
    assert info.value.key == "slurm.nodes"
    assert str(info.value) == ("slurm.nodes: 11 ctx workers x 4 GPUs + 1 gen workers x 16 GPUs = 60 GPUs "
                               "do not fit 14 nodes x 4 GPUs per node = 56 GPUs")


def test_narrow_workers_share_a_node_with_distinct_gpus() -> None:
    pools = (PoolSpec("ctx", 3, 2, 8100, gpus_per_worker=2), PoolSpec("gen", 1, 2, 8200, gpus_per_worker=4))
    workers = place_workers(pools, nodes=3, gpus_per_node=4)
    assert [(w.name, w.nodes, w.gpus) for w in workers] == [
        ("ctx-0", (0,), (0, 1)), ("ctx-1", (0,), (2, 3)), ("ctx-2", (1,), (0, 1)), ("gen-0", (2,), (0, 1, 2, 3))]


def test_wide_workers_take_whole_nodes_from_the_end() -> None:
    # Narrow workers pack from node 0, so whole nodes stay together at the end for wide ones.
    pools = (PoolSpec("ctx", 2, 1, 8100, gpus_per_worker=2), PoolSpec("gen", 1, 1, 8200, tensor_parallel_size=8))
    workers = place_workers(pools, nodes=3, gpus_per_node=4)
    assert [(w.name, w.nodes, w.gpus) for w in workers] == [
        ("ctx-0", (0,), (0, 1)), ("ctx-1", (0,), (2, 3)), ("gen-0", (1, 2), (0, 1, 2, 3))]


def test_fragmentation_is_refused_with_the_free_gpus() -> None:
    pools = (PoolSpec("ctx", 3, 1, 8100, gpus_per_worker=3),)
    with pytest.raises(PlacementError) as info:
        place_workers(pools, nodes=2, gpus_per_node=4)  # 9 GPUs fit 8? no: the total check fires first
    assert "3 ctx workers x 3 GPUs = 9 GPUs do not fit 2 nodes x 4 GPUs per node = 8 GPUs" in str(info.value)
    pools = (PoolSpec("ctx", 2, 1, 8100, gpus_per_worker=3), PoolSpec("gen", 1, 1, 8200, gpus_per_worker=2))
    with pytest.raises(PlacementError) as info:
        place_workers(pools, nodes=2, gpus_per_node=4)
    assert str(info.value) == "slurm.nodes: gen-0 needs 2 GPUs on one node; free GPUs per node: [1, 1]"


def test_a_single_process_cannot_span_nodes() -> None:
    with pytest.raises(PlacementError) as info:
        place_workers((PoolSpec("gen", 1, 1, 8200, gpus_per_worker=8),), nodes=2, gpus_per_node=4)
    assert str(info.value) == "pools.gen.tensor_parallel_size: gen-0: 1 TP ranks do not split evenly over 2 nodes"


def test_wider_than_a_node_must_be_whole_nodes() -> None:
    with pytest.raises(PlacementError) as info:
        place_workers((PoolSpec("gen", 1, 1, 8200, gpus_per_worker=6),), nodes=2, gpus_per_node=4)
    assert info.value.key == "pools.gen.gpus_per_worker"
    assert "needs 6 GPUs, more than a node's 4 but not whole nodes" in str(info.value)


def test_cpu_only_workers_go_round_robin() -> None:
    pools = (PoolSpec("ctx", 2, 2, 8100), PoolSpec("gen", 1, 2, 8200, tensor_parallel_size=2))
    workers = place_workers(pools, nodes=2, gpus_per_node=0)
    assert [(w.name, w.nodes, w.gpus, w.num_tasks, w.port) for w in workers] == [
        ("ctx-0", (0,), (), 1, 8100), ("ctx-1", (1,), (), 1, 8101), ("gen-0", (0,), (), 2, 8200)]


def test_overlapping_port_ranges_are_refused() -> None:
    pools = (PoolSpec("ctx", 3, 1, 8100), PoolSpec("gen", 1, 1, 8102))
    with pytest.raises(ConfigError) as info:
        place_workers(pools, nodes=1, gpus_per_node=0)
    assert str(info.value) == ("pools.gen.base_port: ports 8102..8102 overlap ctx's 8100..8102 "
                               "(worker i listens on base_port + i)")


def test_reserved_ports_stay_out_of_the_pools() -> None:
    with pytest.raises(ConfigError) as info:
        place_workers(DSV4_POOLS, nodes=15, gpus_per_node=4, reserved_ports={"orchestrator.port": 8103})
    assert str(info.value) == "orchestrator.port: port 8103 is also ctx-3's (worker i listens on base_port + i)"
    assert len(place_workers(DSV4_POOLS, 15, 4, reserved_ports={"orchestrator.port": 8000})) == 12


@pytest.mark.parametrize(("pool", "key", "words"), [
    (PoolSpec("ctx", 1, 0, 8100), "pools.ctx.frontends", "must be >= 1"),
    (PoolSpec("ctx", 1, 1, 8100, tensor_parallel_size=0), "pools.ctx.tensor_parallel_size", "must be >= 1"),
    (PoolSpec("ctx", 1, 1, 8100, tensor_parallel_size=4, gpus_per_worker=6), "pools.ctx.gpus_per_worker",
     "6 GPUs do not split evenly over tensor_parallel_size 4"),
    (PoolSpec("ctx", 2, 1, 65535), "pools.ctx.base_port", "leaves [1, 65535]"),
    (PoolSpec("ctx", 1, 1, 0), "pools.ctx.base_port", "ports are fixed before the job starts"),
])
def test_pool_validation_names_the_key(pool: PoolSpec, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        place_workers((pool,), nodes=1, gpus_per_node=8)
    assert info.value.key == key and words in str(info.value)


def test_tensor_parallel_ranks_are_counted_by_placement() -> None:
    assert sum(w.num_tasks for w in place_workers(DSV4_POOLS, nodes=15, gpus_per_node=4)) == 60
