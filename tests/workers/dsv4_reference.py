"""Helpers of the DeepSeek-V4 tests: the transformers reference with its indexer's picks recorded."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from workers.engine.model.deepseek_v4.model import DeepseekV4Model, SequenceBatch


def prompt(length: int, seed: int = 1, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


class RecordedReference:
    """transformers' full forward (no cache), with each CSA layer's index scores and selection kept."""

    def __init__(self, model_dir: Path) -> None:
        self.model = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.scores: list[torch.Tensor] = []  # per CSA layer: (S, T), before the causal mask
        self.selections: list[torch.Tensor] = []  # per CSA layer: (S, k), -1 for none
        for layer in self.model.model.layers:
            compressor = layer.self_attn.compressor
            if isinstance(compressor, hf.DeepseekV4CSACompressor):
                compressor.indexer.scorer.register_forward_hook(lambda m, a, out: self.scores.append(out[0]))
                compressor.indexer.register_forward_hook(lambda m, a, out: self.selections.append(out[0]))

    def logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        self.scores.clear()
        self.selections.clear()
        with torch.no_grad():
            return self.model(token_ids.unsqueeze(0)).logits[0]

    def selection_masks(self, num_entries: list[int]) -> list[torch.Tensor]:
        """Each CSA layer's picks as (S, T) bool."""
        masks = []
        for picks, total in zip(self.selections, num_entries):
            mask = torch.zeros(picks.shape[0], total + 1, dtype=torch.bool)
            mask.scatter_(-1, torch.where(picks >= 0, picks, total), True)
            masks.append(mask[:, :total])
        return masks


def full_forward(model: DeepseekV4Model, token_ids: torch.Tensor) -> torch.Tensor:
    return model.forward(token_ids, [SequenceBatch(model.new_state(), token_ids.shape[0])])


def greedy_tokens(model: DeepseekV4Model, ids: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens after ``ids``, one sequence alone: prefill, then cached decode."""
    state, out = model.new_state(), []
    logits = model.forward(torch.tensor(ids), [SequenceBatch(state, len(ids))])[-1]
    for _ in range(steps):
        out.append(int(logits.argmax()))
        logits = model.forward(torch.tensor(out[-1:]), [SequenceBatch(state, 1)])[0]
    return out
