"""Our DeepSeek-V4 forward against transformers' full forward (no cache), float32 on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.workers.dsv4_reference import RecordedReference, full_forward, prompt
from workers.engine.model.deepseek_v4 import attention as attention_module
from workers.engine.model.deepseek_v4.model import DeepseekV4Model


def _max_abs_diff(model_dir: Path, length: int) -> float:
    ids = prompt(length)
    expected = RecordedReference(model_dir).logits(ids)
    return (full_forward(DeepseekV4Model.from_dir(model_dir), ids) - expected).abs().max().item()


def test_logits_match_reference_past_the_window(tiny_dsv4_keep_all_dir: Path) -> None:
    # 300 tokens: past the 128-token window, 75 CSA entries, 2 HCA entries.
    assert _max_abs_diff(tiny_dsv4_keep_all_dir, 300) < 1e-4


@pytest.mark.slow
@pytest.mark.timeout(1800)  # minutes of CPU on a busy 2-core machine
def test_logits_match_reference_over_1500_tokens(tiny_dsv4_keep_all_dir: Path) -> None:
    # index_topk 4096 >= the 375 CSA entries: no selection, so the definition is exact.
    assert _max_abs_diff(tiny_dsv4_keep_all_dir, 1500) < 1e-4


def _record_ours(monkeypatch: pytest.MonkeyPatch, forced: list[torch.Tensor] | None = None) -> list[tuple]:
    """Our (scores, selection) per CSA layer call; with ``forced``, those selections replace ours."""
    calls: list[tuple] = []
    select = attention_module.select_entries

    def recording(scores: torch.Tensor, positions: torch.Tensor, rate: int, top_k: int) -> torch.Tensor:
        chosen = select(scores, positions, rate, top_k) if forced is None else forced[len(calls)]
        calls.append((scores, chosen))
        return chosen

    monkeypatch.setattr(attention_module, "select_entries", recording)
    return calls


@pytest.mark.slow
@pytest.mark.timeout(1800)  # minutes of CPU on a busy 2-core machine
def test_selection_matches_reference_where_scores_are_apart(tiny_dsv4_dir: Path, monkeypatch) -> None:
    length, gap_needed = 1500, 1e-4
    ids = prompt(length)
    reference = RecordedReference(tiny_dsv4_dir)
    reference.logits(ids)
    ours = _record_ours(monkeypatch)
    model = DeepseekV4Model.from_dir(tiny_dsv4_dir)
    full_forward(model, ids)
    k = model.config.index_topk
    visible = (torch.arange(length) + 1) // model.config.csa_rate
    # The first CSA layer: both sides' inputs agree to float noise, so their picks must agree
    # wherever the k-th and (k+1)-th scores are apart (later layers inherit any near-tie's choice).
    ref_scores = reference.scores[0]
    masked = ref_scores.masked_fill(torch.arange(ref_scores.shape[-1]) >= visible.unsqueeze(-1), float("-inf"))
    ordered = masked.sort(dim=-1, descending=True).values
    comparable = (visible > k) & (ordered[:, k - 1] - ordered[:, k] > gap_needed)
    assert comparable.sum() > 0.9 * (visible > k).sum()
    ours_scores, ours_selected = ours[0]
    reference_selected = reference.selection_masks([ref_scores.shape[-1]])[0]
    assert torch.equal(ours_selected[comparable], reference_selected[comparable])
    finite = torch.isfinite(masked)
    assert (ours_scores[finite] - masked[finite]).abs().max() < 1e-4


@pytest.mark.slow
@pytest.mark.timeout(1800)  # minutes of CPU on a busy 2-core machine
def test_logits_match_reference_given_its_selection(tiny_dsv4_dir: Path, monkeypatch) -> None:
    ids = prompt(1500)
    reference = RecordedReference(tiny_dsv4_dir)
    expected = reference.logits(ids)
    entries = [scores.shape[-1] for scores in reference.scores]
    _record_ours(monkeypatch, forced=reference.selection_masks(entries))
    got = full_forward(DeepseekV4Model.from_dir(tiny_dsv4_dir), ids)
    assert (got - expected).abs().max() < 1e-4
