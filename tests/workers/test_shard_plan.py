"""Sharded loading without a process group: each rank's tensors are exactly its slice of
the whole model's (safetensors and GGUF), and the KV-head layout and pull plans."""

from __future__ import annotations

import pytest
import torch

from tests.workers.gguf_files import write_gguf
from workers.config import ConfigError
from workers.engine.model.loader import load_model
from workers.engine.model.parallel import TensorParallel, check_shardable, head_shard
from workers.engine.model.tiny import make_tiny_model
from workers.kv_layout import PullSource, RankKV, format_layout, parse_layout, plan_pulls

CPU = torch.device("cpu")


def _state(model) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in model.state_dict().items() if not name.startswith("rotary")}


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_each_rank_loads_exactly_its_slice(tmp_path, fmt):
    model_dir = make_tiny_model(tmp_path / "m", size="test", arch="qwen2")  # q/k/v biases too
    path = write_gguf(model_dir, tmp_path / "m.gguf") if fmt == "gguf" else model_dir
    full, config = load_model(path, "float32", CPU)
    whole = _state(full)
    shards = [_state(load_model(path, "float32", CPU, tp=TensorParallel(rank, 2))[0]) for rank in range(2)]
    assert shards[0].keys() == whole.keys()
    d = config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    for name, tensor in whole.items():
        parts = [shard[name] for shard in shards]
        if "qkv_proj" in name:  # [q | k | v] per rank, each half of its own section
            split = [torch.split(p, [q // 2, kv // 2, kv // 2]) for p in parts]
            expected = torch.cat([torch.cat([s[i] for s in split]) for i in range(3)])
            assert torch.equal(expected, tensor), name
        elif "gate_up_proj" in name:
            halves = [p.chunk(2) for p in parts]
            assert torch.equal(torch.cat([h[0] for h in halves] + [h[1] for h in halves]), tensor), name
        elif "o_proj" in name or "down_proj" in name:
            assert torch.equal(torch.cat(parts, dim=1), tensor), name
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(torch.cat(parts)[: tensor.shape[0]], tensor), name
        else:  # norms: whole on every rank
            assert all(torch.equal(p, tensor) for p in parts), name


def test_vocabulary_shards_pad_the_last_rank(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", size="tp", tie_word_embeddings=True)  # vocab 512
    shards = [load_model(model_dir, "float32", CPU, tp=TensorParallel(rank, 3))[0] for rank in range(3)]
    assert [s.embed_tokens.weight.shape[0] for s in shards] == [171, 171, 171]
    assert torch.count_nonzero(shards[2].embed_tokens.weight[170:]) == 0  # 512 = 171 + 171 + 170
    assert all(s.lm_head.weight is s.embed_tokens.weight for s in shards)  # tied: one shard


def test_heads_split_or_replicate_and_bad_sizes_name_the_key():
    assert [head_shard(4, 2, r, 2).kv_heads for r in range(2)] == [range(0, 1), range(1, 2)]
    assert [head_shard(4, 2, r, 4).kv_heads for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert [head_shard(12, 6, r, 3).q_heads for r in range(3)] == [range(0, 4), range(4, 8), range(8, 12)]
    for heads, kv, inter, size in ((4, 2, 128, 3), (6, 4, 120, 3), (4, 4, 130, 4)):
        with pytest.raises(ConfigError, match="tensor_parallel_size"):
            check_shardable(heads, kv, inter, size)


def test_layout_round_trips_and_single_endpoints_hold_every_head():
    ranks = [RankKV("tcp://a:1", range(0, 2)), RankKV("tcp://b:2", range(2, 4))]
    assert parse_layout(format_layout(ranks), 4) == ranks
    assert parse_layout("tcp://a:1", 4) == [RankKV("tcp://a:1", range(4))]
    for bad in ("http://a:1", "tcp://a:1;kv=0-5", "tcp://a:1;kv=2-1", "tcp://a:1;kv=x-1"):
        with pytest.raises(ValueError):
            parse_layout(bad, 4)


def test_each_gen_rank_pulls_its_heads_once():
    ctx2 = [RankKV("tcp://c0:1", range(0, 2)), RankKV("tcp://c1:1", range(2, 4))]
    # gen TP 1 from ctx TP 2: both ctx ranks, into heads 0-1 and 2-3
    assert plan_pulls(ctx2, range(4)) == [PullSource("tcp://c0:1", range(0, 2), range(0, 2)),
                                          PullSource("tcp://c1:1", range(0, 2), range(2, 4))]
    # gen TP 4 rank 3 (head 3) from ctx TP 2: ctx rank 1's second head
    assert plan_pulls(ctx2, range(3, 4)) == [PullSource("tcp://c1:1", range(1, 2), range(0, 1))]
    # replicated ctx heads (TP 4 over 2 KV heads): each head from its first holder only
    ctx4 = [RankKV(f"tcp://c{r}:1", range(r // 2, r // 2 + 1)) for r in range(4)]
    assert plan_pulls(ctx4, range(2)) == [PullSource("tcp://c0:1", range(0, 1), range(0, 1)),
                                          PullSource("tcp://c2:1", range(0, 1), range(1, 2))]
    with pytest.raises(ValueError, match="no ctx rank holds KV head 4"):
        plan_pulls(ctx2, range(3, 5))
