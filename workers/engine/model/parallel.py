"""Tensor parallelism of a Llama-family model: who owns which heads, rows and vocabulary.

A group of ``size`` ranks splits every layer Megatron-style:

=================  ===========================================================
qkv_proj           column-parallel: rank r computes its query heads and the
                   KV heads they read (``HeadShard``)
o_proj             row-parallel over those query heads, then an all-reduce
gate_up_proj       column-parallel over the intermediate size
down_proj          row-parallel over it, then an all-reduce
embed_tokens       vocabulary-parallel: rank r looks up the ids in its range,
                   the others give zeros, an all-reduce sums them
lm_head            vocabulary-parallel (the same ranges, so a tied head shares
                   the embedding's shard); rank 0 gathers the full logits
=================  ===========================================================

KV heads are split when ``size`` divides them and replicated when they divide
``size`` (each rank then holds the one KV head its query heads read); other
layouts are refused. A rank's KV cache holds only its KV heads.

``TensorParallel`` is None for a single rank: the model then takes none of
these paths (no collective, no check beyond ``is None``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from workers.config import ConfigError

__all__ = ["HeadShard", "TensorParallel", "head_shard", "check_shardable", "tcp_store", "init_process_group"]

TP_KEY = "tensor_parallel_size"


@dataclass(frozen=True)
class HeadShard:
    """The query heads and KV heads (global indices) one rank computes."""

    q_heads: range
    kv_heads: range


def head_shard(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    per_rank = num_heads // size
    q_heads = range(rank * per_rank, (rank + 1) * per_rank)
    if num_kv_heads >= size:  # split: each rank owns num_kv_heads / size heads
        kv_per_rank = num_kv_heads // size
        return HeadShard(q_heads, range(rank * kv_per_rank, (rank + 1) * kv_per_rank))
    # Replicated: size / num_kv_heads ranks share one KV head, the one their query heads read.
    group = num_heads // num_kv_heads
    kv = q_heads.start // group
    return HeadShard(q_heads, range(kv, kv + 1))


def check_shardable(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> None:
    """Raise ConfigError (naming tensor_parallel_size) when the model does not split over ``size`` ranks."""
    if size < 1:
        raise ConfigError(TP_KEY, f"must be >= 1, got {size}")
    if num_heads % size:
        raise ConfigError(TP_KEY, f"{size} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise ConfigError(TP_KEY, f"{size} neither divides nor is a multiple of the model's "
                                  f"{num_kv_heads} KV heads")
    if intermediate_size % size:
        raise ConfigError(TP_KEY, f"{size} does not divide the model's intermediate size {intermediate_size}")


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in an initialised ``torch.distributed`` group of ``size`` > 1 ranks."""

    rank: int
    size: int
    group: Any = None  # the process group; None is the default (world) group

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        return head_shard(num_heads, num_kv_heads, self.rank, self.size)

    def rows(self, total: int) -> range:
        """This rank's even share of ``total`` (divisible by size) rows or columns."""
        per_rank = total // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def vocab_rows(self, vocab_size: int) -> tuple[range, int]:
        """This rank's vocabulary range and its padded length ceil(vocab / size): every
        rank's shard has the same shape (the gather needs it), the last one zero-padded."""
        padded = -(-vocab_size // self.size)
        start = min(self.rank * padded, vocab_size)
        return range(start, min(start + padded, vocab_size)), padded

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """(S, padded vocab) on every rank -> (S, vocab) on rank 0, an empty tensor elsewhere."""
        if local.shape[0] == 0:  # every rank has the same S: all skip the gather together
            return local.new_empty((0, vocab_size if self.rank == 0 else 0))
        if self.rank != 0:
            dist.gather(local, None, dst=0, group=self.group)
            return local[:, :0]
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.gather(local, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=1)[:, :vocab_size]


def tcp_store(addr: str, port: int, size: int, is_master: bool, timeout_seconds: float) -> dist.TCPStore:
    """The group's rendezvous store: rank 0 hosts it (``port`` 0: a free port, ``store.port``
    says which), the others connect to ``addr:port``."""
    # wait_for_workers=False: rank 0 must send the port to the others before they can come.
    return dist.TCPStore(addr, port, size, is_master, timedelta(seconds=timeout_seconds), wait_for_workers=False)


def init_process_group(
    rank: int, size: int, store: dist.Store, device: torch.device, timeout_seconds: float
) -> TensorParallel:
    """Join the torch.distributed group of ``size`` ranks that meet at ``store``.

    gloo on the CPU, NCCL on CUDA. ``timeout_seconds`` bounds every collective, so a
    rank that stops answering (rather than dying, which closes its sockets and fails
    the peers' collectives at once) fails the others instead of hanging them.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_seconds))
    return TensorParallel(rank=rank, size=size)
