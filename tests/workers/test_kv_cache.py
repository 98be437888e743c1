"""The paged KV pool, and moving blocks between two engines of the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from workers.config import CacheConfig, ConfigError, EngineConfig
from workers.engine.executor import ScheduledRequest, SchedulerOutput
from workers.engine.kv_cache import KVCache, KVCacheShape, num_blocks_for
from workers.engine.model.tiny import make_tiny_model
from workers.engine.model_runner import ModelRunner
from workers.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [0, 47, 268, 290, 228, 42, 72, 77, 418, 228]  # 10 tokens: 3 blocks of 4
SHAPE = KVCacheShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _runner(model_dir: Path, dtype: str = "float32") -> ModelRunner:
    cache = CacheConfig(block_size=4, num_blocks=12)
    return ModelRunner(EngineConfig(model=str(model_dir), device="cpu", dtype=dtype, cache=cache))


def _step(tokens: list[int], start: int, blocks: list[int], outputs: int = 0) -> SchedulerOutput:
    return SchedulerOutput([ScheduledRequest(1, tokens, start, blocks, True, GREEDY, outputs)])


def _floats(buffer: memoryview, num_blocks: int) -> torch.Tensor:
    """A wire frame back as (n, BS, KVH, D) float32."""
    return torch.from_numpy(np.frombuffer(buffer, dtype=np.float32).copy()).view(num_blocks, 4, 2, 8)


def test_layer_views_share_one_storage() -> None:
    cache = KVCache(SHAPE, num_blocks=5, device=torch.device("cpu"))
    assert cache.key_cache(1).shape == (5, 4, 2, 8)
    cache.value_cache(1)[3, 2] = 7.0
    assert cache.key_cache(1).is_contiguous()
    assert torch.equal(cache.storage[1, 1, 3, 2], torch.full((2, 8), 7.0))
    buffers = cache.export_buffers([3, 0])  # K, V of layer 0, then of layer 1
    assert [b.nbytes for b in buffers] == [2 * 4 * 2 * 8 * 4] * 4 and all(b.c_contiguous for b in buffers)
    frame = _floats(buffers[3], 2)
    assert torch.equal(frame[0, 2], torch.full((2, 8), 7.0)) and frame[1].abs().sum() == 0


def test_consecutive_blocks_export_as_views_of_the_pool() -> None:
    cache = KVCache(SHAPE, num_blocks=5, device=torch.device("cpu"))
    cache.storage.normal_()
    views, gathered = cache.export_buffers([1, 2, 3]), cache.export_buffers([3, 2])
    pool = cache.storage.view(torch.uint8).numpy()
    assert all(np.shares_memory(np.asarray(b), pool) for b in views)  # zero-copy
    assert not any(np.shares_memory(np.asarray(b), pool) for b in gathered)
    assert torch.equal(_floats(views[2], 3)[2], cache.key_cache(1)[3])
    assert torch.equal(_floats(gathered[1], 2)[1], cache.value_cache(0)[2])


def test_import_checks_shape_and_ids() -> None:
    cache = KVCache(SHAPE, num_blocks=5, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="block id 5 out of range"):
        cache.export_buffers([5])
    with pytest.raises(ValueError, match="a frame of 100 bytes for 1 blocks, expected 256"):
        cache.import_buffers([1], [bytes(256), bytes(100), bytes(256), bytes(256)])
    with pytest.raises(ValueError, match="expected 4 frames"):
        cache.import_buffers([1], [bytes(256)] * 3)
    frames = [np.arange(64, dtype=np.float32) + 64 * i for i in range(4)]  # one block's K or V: 4 x 2 x 8
    for ids in ([4], [2, 1], [0, 1]):  # one block; descending ids; ascending (a slice of the pool)
        cache.import_buffers(ids, [np.concatenate([f + 1000 * j for j in range(len(ids))]).tobytes() for f in frames])
        for j, block in enumerate(ids):
            assert torch.equal(cache.storage[0, 1, block].flatten(), torch.from_numpy(frames[1] + 1000 * j))
            assert torch.equal(cache.storage[1, 0, block].flatten(), torch.from_numpy(frames[2] + 1000 * j))
    assert [bytes(b) for b in cache.export_buffers([4])] == [f.tobytes() for f in frames]


def test_num_blocks_from_memory_budget() -> None:
    assert SHAPE.bytes_per_block == 2 * 2 * 4 * 2 * 8 * 4
    assert num_blocks_for(CacheConfig(num_blocks=7), SHAPE) == 7
    assert num_blocks_for(CacheConfig(memory_bytes=SHAPE.bytes_per_block * 10 + 5), SHAPE) == 10
    with pytest.raises(ConfigError, match="engine.cache.memory_bytes"):
        num_blocks_for(CacheConfig(memory_bytes=100), SHAPE)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_import_between_runners_continues_identically(model_dir: Path, dtype: str) -> None:
    context, generation = _runner(model_dir, dtype), _runner(model_dir, dtype)
    first = context.execute(_step(PROMPT, 0, [7, 2, 10])).token_ids[0]
    buffers = context.export_blocks([7, 2, 10])
    shape = context.kv_cache.shape
    assert [memoryview(b).nbytes for b in buffers] == [3 * shape.bytes_per_block // (2 * shape.num_layers)] * (
        2 * shape.num_layers)
    # Through bytes, as a transfer would deliver them, into other block ids.
    generation.import_blocks([4, 0, 11], [bytes(b) for b in buffers])
    assert [bytes(b) for b in generation.export_blocks([4, 0, 11])] == [bytes(b) for b in buffers]
    # The next decode reads the imported KV: identical logits to the engine that computed it.
    on_context = context.compute_logits(_step([first], len(PROMPT), [7, 2, 10], 1))
    on_generation = generation.compute_logits(_step([first], len(PROMPT), [4, 0, 11], 1))
    assert torch.equal(on_context, on_generation)
    # Without the import the same step sees an empty cache and differs.
    fresh = _runner(model_dir, dtype).compute_logits(_step([first], len(PROMPT), [4, 0, 11], 1))
    assert not torch.allclose(fresh, on_context, atol=1e-2)


def test_import_rejects_wrong_buffers(model_dir: Path) -> None:
    runner = _runner(model_dir)
    shape = runner.kv_cache.shape
    frame = shape.bytes_per_block // (2 * shape.num_layers)  # one block's K or V of one layer
    with pytest.raises(ValueError, match=f"expected {2 * shape.num_layers} frames"):
        runner.import_blocks([0, 1], [bytes(2 * frame)])
    with pytest.raises(ValueError, match=f"a frame of 10 bytes for 1 blocks, expected {frame}"):
        runner.import_blocks([3], [bytes(10)] * (2 * shape.num_layers))
