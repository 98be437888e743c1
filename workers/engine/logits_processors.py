"""What the sampler does to a batch's logits before it picks: penalties, logit bias,
grammar masks, min-p.

Each processor touches only the rows that ask for it (gathered, changed,
scattered back), so a row without these settings keeps its logits bit for bit
and costs nothing when no row in the batch uses them.

Penalties follow vLLM and the OpenAI API: ``presence_penalty`` is subtracted
once from every token already generated, ``frequency_penalty`` once per
occurrence; ``repetition_penalty`` (CTRL / Hugging Face) divides the positive
and multiplies the negative logits of every token of the prompt or the output.
Grammar masks come from each constrained row's llguidance matcher: a bitmask
of the allowed tokens (bit ``t % 32`` of word ``t // 32``), filled on the CPU,
expanded on the logits' device, disallowed tokens set to -inf.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from workers.sampling_params import SamplingParams

if TYPE_CHECKING:
    from workers.engine.sampler import SamplingRow

__all__ = ["apply_penalties", "apply_logit_bias", "apply_grammar_masks", "apply_min_p", "has_penalties"]

_NEG_INF = float("-inf")


def has_penalties(params: SamplingParams) -> bool:
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow], index: list[int]) -> None:
    """In place on ``logits`` (S, V): the penalties of the rows in ``index``."""
    device, vocab_size = logits.device, logits.shape[1]
    params = [rows[i].params for i in index]
    sub = logits[index]  # (R, V)
    counts = torch.zeros_like(sub)  # occurrences of each token in the row's output
    row_ix, token_ix = _flat_ids([rows[i].output_token_ids for i in index], vocab_size)
    if row_ix:
        rows_t, tokens_t = torch.tensor(row_ix, device=device), torch.tensor(token_ix, device=device)
        counts.index_put_((rows_t, tokens_t), torch.ones(len(row_ix), device=device), accumulate=True)
    generated = counts > 0
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = generated.clone()
        prompts = [rows[i].prompt_token_ids if p.repetition_penalty != 1.0 else () for i, p in zip(index, params)]
        row_ix, token_ix = _flat_ids(prompts, vocab_size)
        if row_ix:
            seen[torch.tensor(row_ix, device=device), torch.tensor(token_ix, device=device)] = True
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)  # (R, 1)
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
    logits[index] = sub - frequency * counts - presence * generated.to(sub.dtype)


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow], index: list[int]) -> None:
    """In place: each row's ``logit_bias`` added to its tokens (ids outside the vocabulary ignored)."""
    vocab_size = logits.shape[1]
    entries = [(i, token_id, bias) for i in index for token_id, bias in rows[i].params.logit_bias
               if 0 <= token_id < vocab_size]
    if not entries:
        return
    row_ix, token_ix, biases = zip(*entries)
    device = logits.device
    logits.index_put_(
        (torch.tensor(row_ix, device=device), torch.tensor(token_ix, device=device)),
        torch.tensor(biases, dtype=logits.dtype, device=device),
        accumulate=True,
    )


def apply_grammar_masks(logits: torch.Tensor, rows: Sequence[SamplingRow], index: list[int]) -> None:
    """In place: every token its row's grammar does not allow next becomes -inf."""
    vocab_size = logits.shape[1]
    num_words = (vocab_size + 31) // 32
    bitmask = np.zeros((len(index), num_words), dtype=np.int32)  # (R, W)
    # Row pointers computed once: numpy's per-call ``.ctypes`` costs ~20 us a row,
    # more than llguidance takes to fill the mask.
    base, row_bytes = bitmask.ctypes.data, 4 * num_words
    for j, i in enumerate(index):
        rows[i].grammar.unsafe_compute_mask_ptr(base + j * row_bytes, row_bytes)
    if logits.device.type == "cpu":
        # Little-endian words: byte t // 8, bit t % 8 holds token t.
        allowed = torch.from_numpy(np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little"))
    else:  # ship the 32x smaller bitmask, expand it on the device
        words = torch.from_numpy(bitmask).to(logits.device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).reshape(len(index), -1)
    disallowed = allowed[:, :vocab_size] == 0  # (R, V)
    if len(index) == logits.shape[0]:  # every row constrained: no gather and scatter
        logits.masked_fill_(disallowed, _NEG_INF)
    else:
        logits[index] = logits[index].masked_fill(disallowed, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` (R,) times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)  # (R, V)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def _flat_ids(id_lists: Sequence[Sequence[int]], vocab_size: int) -> tuple[list[int], list[int]]:
    """(row, token id) pairs of every id in range, row by row."""
    row_ix: list[int] = []
    token_ix: list[int] = []
    for row, ids in enumerate(id_lists):
        kept = [t for t in ids if 0 <= t < vocab_size]
        row_ix.extend([row] * len(kept))
        token_ix.extend(kept)
    return row_ix, token_ix
