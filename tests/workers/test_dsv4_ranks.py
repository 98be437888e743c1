"""DeepSeek-V4 across a worker's ranks: 2 and 4 ranks give 1 rank's logits and greedy tokens.

Every rank is a real process joined by gloo over 127.0.0.1
(``dsv4_rank_forward.py``), running the engine's ``DeepseekV4Runner`` on its
share (``shard.py``): 2 ranks hold one whole output group of heads each, 4
ranks half a group each; 8 or 4 of the 16 routed experts of every hash and
top-k MoE layer; a slice of the shared expert and of the vocabulary.
Tolerance as for Llama's TP: float32 logits within 1e-4 absolute (the
all-reduces only reorder sums), greedy tokens equal, here over 4 prompts of
9 to 300 tokens (past the window, the indexer selecting 16 of 75 CSA
entries, a chunked prefill cut off the compression boundaries) and 8 decode
steps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.workers.test_tp_model import run_ranks as run_tp_ranks
from workers.config import ConfigError
from workers.engine.model.deepseek_v4.config import load_dsv4_config
from workers.engine.model.deepseek_v4.shard import check_dsv4_shardable, rank_share

HELPER = Path(__file__).with_name("dsv4_rank_forward.py")
ATOL = 1e-4


def run_ranks(model_dir: Path, size: int, out: Path) -> dict[str, np.ndarray]:
    return run_tp_ranks(model_dir, size, out, HELPER, timeout=600)


@pytest.fixture(scope="module")
def one_rank(tiny_dsv4_dir, tmp_path_factory) -> dict[str, np.ndarray]:
    return run_ranks(tiny_dsv4_dir, 1, tmp_path_factory.mktemp("dsv4-tp1") / "out.npz")


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("size", [2, 4])
def test_ranks_match_one_rank(tiny_dsv4_dir, one_rank, size, tmp_path):
    got = run_ranks(tiny_dsv4_dir, size, tmp_path / "out.npz")
    # 4 sampled rows, then the 45-token prompt's 44 rows of prompt logprobs
    assert got["prefill_logits"].shape == one_rank["prefill_logits"].shape == (48, 512)
    np.testing.assert_allclose(got["prefill_logits"], one_rank["prefill_logits"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(got["decode_logits"], one_rank["decode_logits"], atol=ATOL, rtol=0)
    assert (got["tokens"] == one_rank["tokens"]).all()


def test_rank_shares_cover_the_model_once(tiny_dsv4_dir):
    config = load_dsv4_config(tiny_dsv4_dir)  # 4 heads in 2 output groups, 16 experts, shared expert of 32
    for size in (1, 2, 4):
        shares = [rank_share(config, rank, size) for rank in range(size)]
        assert [h for s in shares for h in s.heads] == list(range(4))
        assert [e for s in shares for e in s.experts] == list(range(16))
        assert [r for s in shares for r in s.shared_rows] == list(range(32))
    two, four = rank_share(config, 1, 2), rank_share(config, 3, 4)
    assert (two.groups, two.group_columns) == (range(1, 2), range(0, 64))  # one whole group of 2 heads
    assert (four.groups, four.group_columns) == (range(1, 2), range(32, 64))  # the second head of group 1


@pytest.mark.parametrize(("size", "key"), [(3, "attention heads"), (8, "attention heads")])
def test_a_layout_the_model_does_not_split_over_is_refused(tiny_dsv4_dir, size, key):
    with pytest.raises(ConfigError, match=key) as error:
        check_dsv4_shardable(load_dsv4_config(tiny_dsv4_dir), size)
    assert error.value.key == "tensor_parallel_size"
