"""Incremental DeepSeek-V4: prefill + cached decode and chunked prefill equal the full forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.workers.dsv4_reference import RecordedReference, full_forward, prompt
from workers.engine.model.deepseek_v4 import attention as attention_module
from workers.engine.model.deepseek_v4.cache_bytes import state_bytes
from workers.engine.model.deepseek_v4.model import DeepseekV4Model, SequenceBatch
from workers.engine.model.deepseek_v4.state import SequenceState


def _greedy(model: DeepseekV4Model, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``ids`` then ``steps`` cached greedy decodes: (the tokens, each step's logits)."""
    state = model.new_state()
    logits = model.forward(ids, [SequenceBatch(state, ids.shape[0])])[-1]
    tokens, step_logits = [], [logits]
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = model.forward(torch.tensor(tokens[-1:]), [SequenceBatch(state, 1)])[0]
        step_logits.append(logits)
    return torch.tensor(tokens), torch.stack(step_logits[:-1])


def _chunked(model: DeepseekV4Model, ids: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    state, pieces, start = model.new_state(), [], 0
    for end in [*cuts, ids.shape[0]]:
        pieces.append(model.forward(ids[start:end], [SequenceBatch(state, end - start)]))
        start = end
    return torch.cat(pieces)


def _decode_against_reference(model_dir: Path, length: int, steps: int) -> None:
    model = DeepseekV4Model.from_dir(model_dir)
    ids = prompt(length)
    tokens, step_logits = _greedy(model, ids, steps)
    expected = RecordedReference(model_dir).logits(torch.cat([ids, tokens]))[length - 1 : length - 1 + steps]
    assert torch.equal(expected.argmax(-1), tokens)
    assert (step_logits - expected).abs().max() < 1e-4


def test_cached_decode_equals_the_reference_full_forward(tiny_dsv4_keep_all_dir: Path) -> None:
    # 250 + 16: the decode crosses a CSA boundary every 4 tokens and the HCA boundary at 256.
    _decode_against_reference(tiny_dsv4_keep_all_dir, 250, 16)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # minutes of CPU on a busy 2-core machine
def test_64_decode_steps_after_1500_tokens_equal_the_reference(tiny_dsv4_keep_all_dir: Path) -> None:
    _decode_against_reference(tiny_dsv4_keep_all_dir, 1500, 64)


# Chunked and whole prefills differ only by float summation order (matmuls of other shapes, softmaxes
# over other key counts): measured 1.1e-5 to 2e-5 max-abs on logits of std 2, the same with the indexer
# keeping every entry. A different pick by the indexer would move them by 1e-2 or more, and the picks
# are compared exactly.
_FLOAT_NOISE = 5e-5


def _assert_chunked_equals_whole(model: DeepseekV4Model, ids: torch.Tensor, cuts: list[int], monkeypatch) -> None:
    picks: list[torch.Tensor] = []
    select = attention_module.select_entries

    def recording(scores: torch.Tensor, positions: torch.Tensor, rate: int, top_k: int) -> torch.Tensor:
        picks.append(select(scores, positions, rate, top_k))
        return picks[-1]

    monkeypatch.setattr(attention_module, "select_entries", recording)
    whole = full_forward(model, ids)
    num_csa = len(picks)
    assert (_chunked(model, ids, cuts) - whole).abs().max() < _FLOAT_NOISE
    whole_picks, chunk_picks = picks[:num_csa], picks[num_csa:]
    for layer in range(num_csa):
        total = whole_picks[layer].shape[-1]  # a chunk saw fewer entries: pad its picks to the last one
        rows = torch.cat([torch.nn.functional.pad(p, (0, total - p.shape[-1])) for p in chunk_picks[layer::num_csa]])
        assert torch.equal(rows, whole_picks[layer])


@pytest.mark.parametrize("cuts", [[1, 2, 7, 130, 131, 259], [127, 128, 129, 255, 257]])
def test_chunked_prefill_off_the_boundaries_equals_one_prefill(
    tiny_dsv4_dir: Path, cuts: list[int], monkeypatch
) -> None:
    # The selecting checkpoint: the indexer picks 16 of up to 75 entries, and must pick the same.
    _assert_chunked_equals_whole(DeepseekV4Model.from_dir(tiny_dsv4_dir), prompt(300), cuts, monkeypatch)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # minutes of CPU on a busy 2-core machine
def test_chunked_prefill_over_1500_tokens_equals_one_prefill(tiny_dsv4_dir: Path, monkeypatch) -> None:
    model = DeepseekV4Model.from_dir(tiny_dsv4_dir)
    _assert_chunked_equals_whole(model, prompt(1500), [3, 257, 513, 514, 1001, 1283], monkeypatch)


def test_sequences_batched_together_equal_each_alone(tiny_dsv4_dir: Path) -> None:
    model = DeepseekV4Model.from_dir(tiny_dsv4_dir)
    prompts = [prompt(length, seed=length) for length in (5, 140, 261)]
    alone = [full_forward(model, ids) for ids in prompts]
    states = [model.new_state() for _ in prompts]
    batched = model.forward(torch.cat(prompts), [SequenceBatch(s, p.shape[0]) for s, p in zip(states, prompts)])
    assert (batched - torch.cat(alone)).abs().max() < _FLOAT_NOISE
    # And one decode step of all three at once: each sequence at its own position.
    next_ids = torch.tensor([int(a[-1].argmax()) for a in alone])
    step = model.forward(next_ids, [SequenceBatch(s, 1) for s in states])
    for index, ids in enumerate(prompts):
        expected = full_forward(model, torch.cat([ids, next_ids[index : index + 1]]))[-1]
        assert (step[index] - expected).abs().max() < _FLOAT_NOISE


def test_state_keeps_a_bounded_window_and_tail(tiny_dsv4_dir: Path) -> None:
    model = DeepseekV4Model.from_dir(tiny_dsv4_dir)
    state: SequenceState = model.new_state()
    model.forward(prompt(261), [SequenceBatch(state, 261)])
    csa, hca = state.layers[1], state.layers[2]
    assert state.layers[0].window.shape[0] == model.config.sliding_window - 1
    assert csa.compressor is not None and csa.indexer is not None and hca.compressor is not None
    assert (csa.compressor.entries.shape[0], csa.compressor.tail_kv.shape[0]) == (65, 1)
    assert csa.indexer.entries.shape == (65, model.config.index_head_dim)
    assert (hca.compressor.entries.shape[0], hca.compressor.tail_kv.shape[0]) == (2, 5)
    # The sizing formula (docs/deepseek_v4.md) bounds what is kept: equal but for the tails' unfilled rows.
    bound = state_bytes(model.config, 261)
    assert bound - 2 * 4 * (3 * 128 + 127 * 32) * 2 <= state.nbytes() <= bound
