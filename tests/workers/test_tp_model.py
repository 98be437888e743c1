"""The sharded Llama forward: TP 2, 3 and 4 give TP 1's logits and greedy tokens.

Every rank is a real process joined by gloo over 127.0.0.1 (``tp_forward.py``).
Tolerance: float32 logits within 1e-4 absolute (the all-reduces only change
the summation order, about 1e-6 relative; the logits are of order 1..10), and
greedy tokens equal over 20 prompts and 9 decode steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.worker_process import free_port
from workers.engine.model.tiny import make_tiny_model

HELPER = Path(__file__).with_name("tp_forward.py")
ATOL = 1e-4


def run_ranks(model_dir: Path, size: int, out: Path, helper: Path = HELPER, timeout: float = 120
              ) -> dict[str, np.ndarray]:
    """Run ``helper MODEL RANK SIZE PORT OUT`` as ``size`` processes, one per rank; rank 0's OUT (.npz)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(helper), str(model_dir), str(rank), str(size), str(port), str(out)],
                         env=env, stderr=subprocess.PIPE, text=True)
        for rank in range(size)
    ]
    errors = []
    for proc in procs:
        try:
            _, stderr = proc.communicate(timeout=timeout)
        finally:
            proc.kill()
        if proc.returncode:
            errors.append(stderr[-3000:])
    assert not errors, "\n".join(errors)
    return dict(np.load(out))


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tp-model"), size="tp")


@pytest.fixture(scope="module")
def tp_reference(tp_model, tmp_path_factory) -> dict[str, np.ndarray]:
    return run_ranks(tp_model, 1, tmp_path_factory.mktemp("tp1") / "out.npz")


@pytest.mark.parametrize("size", [2, 3])
def test_tp_matches_tp1(tp_model, tp_reference, size, tmp_path):
    got = run_ranks(tp_model, size, tmp_path / "out.npz")
    # 20 sampled rows, then the first prompt's rows of prompt logprobs (tp_forward.py)
    assert got["prefill_logits"].shape == tp_reference["prefill_logits"].shape
    assert got["prefill_logits"].shape[0] > 20 and got["prefill_logits"].shape[1] == 512
    np.testing.assert_allclose(got["prefill_logits"], tp_reference["prefill_logits"], atol=ATOL, rtol=0)
    assert (got["tokens"] == tp_reference["tokens"]).all()


def test_replicated_kv_heads_and_tied_embeddings(tmp_path):
    """TP 4 over 2 KV heads (each held by two ranks) with a tied, vocabulary-parallel LM head."""
    model = make_tiny_model(tmp_path / "model", size="test", tie_word_embeddings=True, num_shards=2)
    reference = run_ranks(model, 1, tmp_path / "tp1.npz")
    got = run_ranks(model, 4, tmp_path / "tp4.npz")
    np.testing.assert_allclose(got["prefill_logits"], reference["prefill_logits"], atol=ATOL, rtol=0)
    assert (got["tokens"] == reference["tokens"]).all()
