"""Paged attention over the KV pool, for a step that mixes prefill chunks and decodes.

A step's tokens are flattened: sequence ``i`` owns rows
``[query_start_i, query_start_i + num_query_i)``, which sit at positions
``[start_i, start_i + num_query_i)`` of that sequence. Its block table maps
position ``p`` to slot ``p % block_size`` of block ``block_ids[p // block_size]``.

Per layer: the new K/V are written into their slots first, then every query
attends to its sequence's keys ``[0, start + q]`` (causal with an offset).
Decodes (one query each) run as one padded, masked SDPA call over KV gathered
through the block tables; prefill chunks run one SDPA call per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["SequenceSlice", "PrefillChunk", "AttentionMetadata", "build_attention_metadata", "paged_attention"]


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's share of a step, before it becomes tensors."""

    start_position: int
    num_query_tokens: int
    block_ids: list[int]


@dataclass(frozen=True)
class PrefillChunk:
    query_start: int  # first row in the flattened step
    num_query_tokens: int
    start_position: int  # position of the first query token in its sequence
    block_ids: torch.Tensor  # (ceil(context_len / block_size),) blocks holding keys [0, context_len)
    causal_mask: torch.Tensor | None  # (q, context_len) bool; None when start is 0 (plain causal)


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (N,) block * block_size + offset of each new token
    decode_rows: torch.Tensor  # (B,) rows of the decode tokens in the step
    decode_block_tables: torch.Tensor  # (B, max_blocks), padded with block 0
    decode_key_mask: torch.Tensor  # (B, 1, 1, max_blocks * block_size) true where a key exists
    prefills: list[PrefillChunk]

    @property
    def num_decodes(self) -> int:
        return self.decode_rows.shape[0]


def build_attention_metadata(
    sequences: list[SequenceSlice], block_size: int, device: torch.device
) -> AttentionMetadata:
    """Turn the step's sequences (in flattened order) into index tensors on ``device``."""
    slots: list[int] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_context_lens: list[int] = []
    prefills: list[PrefillChunk] = []
    query_start = 0
    for seq in sequences:
        context_len = seq.start_position + seq.num_query_tokens
        num_blocks = -(-context_len // block_size)
        if len(seq.block_ids) < num_blocks:
            raise ValueError(f"block table of {len(seq.block_ids)} blocks cannot hold {context_len} tokens")
        for position in range(seq.start_position, context_len):
            slots.append(seq.block_ids[position // block_size] * block_size + position % block_size)
        if seq.num_query_tokens == 1:  # a decode, or a one-token chunk: same attention
            decode_rows.append(query_start)
            decode_tables.append(seq.block_ids[:num_blocks])
            decode_context_lens.append(context_len)
        else:
            prefills.append(_prefill_chunk(seq, query_start, num_blocks, device))
        query_start += seq.num_query_tokens
    decode_block_tables = _padded_tables(decode_tables)
    num_decode_keys = decode_block_tables.shape[1] * block_size
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long).to(device),
        decode_rows=torch.tensor(decode_rows, dtype=torch.long).to(device),
        decode_block_tables=decode_block_tables.to(device),
        decode_key_mask=_key_mask(decode_context_lens, num_decode_keys).to(device),
        prefills=prefills,
    )


def _prefill_chunk(seq: SequenceSlice, query_start: int, num_blocks: int, device: torch.device) -> PrefillChunk:
    mask = None
    if seq.start_position > 0:
        context_len = seq.start_position + seq.num_query_tokens
        query_positions = torch.arange(seq.start_position, context_len).unsqueeze(1)  # (q, 1)
        mask = (torch.arange(context_len).unsqueeze(0) <= query_positions).to(device)  # (q, ctx)
    return PrefillChunk(
        query_start=query_start,
        num_query_tokens=seq.num_query_tokens,
        start_position=seq.start_position,
        block_ids=torch.tensor(seq.block_ids[:num_blocks], dtype=torch.long).to(device),
        causal_mask=mask,
    )


def _padded_tables(tables: list[list[int]]) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long).reshape(len(tables), width)


def _key_mask(context_lens: list[int], num_keys: int) -> torch.Tensor:
    lens = torch.tensor(context_lens, dtype=torch.long).unsqueeze(1)  # (B, 1)
    mask = torch.arange(num_keys).unsqueeze(0) < lens  # (B, num_keys)
    return mask[:, None, None, :]  # (B, 1, 1, num_keys): broadcast over heads and the one query


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """Store the step's K/V, then attend. query (N, H, D), key/value (N, KVH, D) -> (N, H, D)."""
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    key_cache.view(num_slots, *key_cache.shape[2:]).index_copy_(0, metadata.slot_mapping, key)  # (NB * BS, KVH, D)
    value_cache.view(num_slots, *value_cache.shape[2:]).index_copy_(0, metadata.slot_mapping, value)
    if not metadata.prefills:
        # Decode-only step (the common case): rows are already 0..B-1, no scatter.
        return _decode_attention(query, key_cache, value_cache, metadata)
    output = torch.empty_like(query)
    if metadata.num_decodes:
        output[metadata.decode_rows] = _decode_attention(query[metadata.decode_rows], key_cache, value_cache, metadata)
    for chunk in metadata.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.num_query_tokens)
        output[rows] = _prefill_attention(query[rows], key[rows], value[rows], key_cache, value_cache, chunk)
    return output


def _decode_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata
) -> torch.Tensor:
    batch, num_heads, head_dim = query.shape
    keys = _gather(key_cache, metadata.decode_block_tables)  # (B, KVH, L, D)
    values = _gather(value_cache, metadata.decode_block_tables)
    out = _sdpa(query.unsqueeze(2), keys, values, metadata.decode_key_mask, is_causal=False)  # (B, H, 1, D)
    return out.reshape(batch, num_heads, head_dim)


def _prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    chunk: PrefillChunk,
) -> torch.Tensor:
    if chunk.causal_mask is None:
        # The chunk starts the sequence: its own K/V are all the keys there are.
        keys, values = key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)  # (1, KVH, q, D)
    else:
        context_len = chunk.causal_mask.shape[1]
        keys = _gather(key_cache, chunk.block_ids.unsqueeze(0))[:, :, :context_len]  # (1, KVH, ctx, D)
        values = _gather(value_cache, chunk.block_ids.unsqueeze(0))[:, :, :context_len]
    queries = query.transpose(0, 1).unsqueeze(0)  # (1, H, q, D)
    out = _sdpa(queries, keys, values, chunk.causal_mask, is_causal=chunk.causal_mask is None)  # (1, H, q, D)
    return out[0].transpose(0, 1)  # (q, H, D)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Keys or values of whole blocks: cache (NB, BS, KVH, D), tables (B, M) -> (B, KVH, M * BS, D)."""
    batch, max_blocks = block_tables.shape
    blocks = cache.index_select(0, block_tables.reshape(-1))  # (B * M, BS, KVH, D)
    return blocks.reshape(batch, max_blocks * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def _sdpa(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, is_causal: bool
) -> torch.Tensor:
    # Grouped-query attention: each KV head serves num_heads / num_kv_heads query
    # heads. enable_gqa broadcasts instead of copying K/V per query head (10x on CPU).
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
