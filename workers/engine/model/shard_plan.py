"""Which part of each checkpoint tensor one tensor-parallel rank loads.

``shard_cuts(config, tp)`` maps every checkpoint tensor name (Hugging Face or
GGUF, ``hf_weight_sources`` / ``gguf_weight_sources``) to the ``Cut`` of it
that rank ``tp.rank`` holds (the layout is in ``parallel.py``). A safetensors
file is read through ``get_slice``, so a rank reads only its rows or columns
from disk; a GGUF tensor is dequantized whole, then cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from workers.engine.model.model_config import ModelConfig
from workers.engine.model.parallel import TensorParallel

__all__ = ["Cut", "shard_cuts", "apply_cut", "finish_cut"]


@dataclass(frozen=True)
class Cut:
    dim: int  # 0: rows, 1: columns
    start: int
    stop: int
    pad_rows: int | None = None  # zero-pad rows up to this many (the vocabulary's last shard)
    zero: bool = False  # this rank holds zeros of the tensor's shape (a row-parallel bias off rank 0)


def shard_cuts(config: ModelConfig, tp: TensorParallel, names: dict[str, list[str]]) -> dict[str, Cut]:
    """Checkpoint name -> this rank's cut, for the ``names`` (our parameter -> its sources) given."""
    shard = tp.heads(config.num_heads, config.num_kv_heads)
    d = config.head_dim
    q = Cut(0, shard.q_heads.start * d, shard.q_heads.stop * d)
    kv = Cut(0, shard.kv_heads.start * d, shard.kv_heads.stop * d)
    inter = tp.rows(config.intermediate_size)
    vocab, padded = tp.vocab_rows(config.vocab_size)
    cuts: dict[str, Cut] = {}
    for ours, sources in names.items():
        kind = ours.split(".")[-2]  # layers.3.mlp.down_proj.weight -> down_proj
        if ours in ("embed_tokens.weight", "lm_head.weight"):
            cut = [Cut(0, vocab.start, vocab.stop, pad_rows=padded)]
        elif kind == "qkv_proj":
            cut = [q, kv, kv]
        elif ours.endswith("o_proj.weight"):
            cut = [Cut(1, q.start, q.stop)]
        elif ours.endswith("o_proj.bias"):  # added once, by rank 0, before the all-reduce sums the ranks
            cut = [Cut(0, 0, config.hidden_size, zero=tp.rank != 0)]
        elif kind == "gate_up_proj":
            cut = [Cut(0, inter.start, inter.stop)] * 2
        elif kind == "down_proj":
            cut = [Cut(1, inter.start, inter.stop)]
        else:  # norms: every rank holds them whole
            continue
        cuts.update(zip(sources, cut))
    return cuts


def apply_cut(tensor: Any, cut: Cut | None) -> Any:
    """``tensor`` (a safetensors slice, a numpy array or a tensor) cut; not yet padded or zeroed."""
    if cut is None or cut.zero:
        return tensor[:] if cut is None else tensor[0:0]
    return tensor[cut.start : cut.stop] if cut.dim == 0 else tensor[:, cut.start : cut.stop]


def finish_cut(tensor: torch.Tensor, cut: Cut | None) -> torch.Tensor:
    """Pad the vocabulary's last shard, or give zeros for a ``zero`` cut."""
    if cut is None:
        return tensor
    if cut.zero:
        return torch.zeros(cut.stop - cut.start, dtype=tensor.dtype, device=tensor.device)
    if cut.pad_rows is not None and tensor.shape[0] < cut.pad_rows:
        pad = tensor.new_zeros((cut.pad_rows - tensor.shape[0], *tensor.shape[1:]))
        return torch.cat([tensor, pad])
    return tensor
