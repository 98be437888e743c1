"""Paged attention over the KV pool, for a step that mixes prefill chunks and decodes.

A step's tokens are flattened: sequence ``i`` owns rows
``[query_start_i, query_start_i + num_query_i)``, which sit at positions
``[start_i, start_i + num_query_i)`` of that sequence. Its block table maps
position ``p`` to slot ``p % block_size`` of block ``block_ids[p // block_size]``.

Per layer: the new K/V are written into their slots first, then every query
attends to its sequence's keys ``[0, start + q]`` (causal with an offset).
Decodes (one query each) run in the native kernel (``native_attention``),
which reads the blocks in place, when the engine has it; otherwise in groups
of similar context length, one padded, masked SDPA call per group over KV
gathered through the block tables just before it. Prefill chunks run one
SDPA call per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.engine.native_attention import DecodeBatch, NativeDecodeKernel

__all__ = [
    "SequenceSlice",
    "PrefillChunk",
    "DecodeGroup",
    "AttentionMetadata",
    "build_attention_metadata",
    "paged_attention",
]


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
    causal_mask: torch.Tensor | None  # (q, context_len) additive, -inf past each query; None when start is 0


@dataclass(frozen=True)
class DecodeGroup:
    """Decodes of similar context length, attended together over KV padded to the longest.

    Sliced once per step, not per layer: every layer attends the same groups.
    """

    rows: slice  # the group's rows among the step's decodes, in ``decode_rows`` order
    block_ids: torch.Tensor  # (b * max_blocks,) the group's block tables, padded with block 0, flattened
    key_mask: torch.Tensor  # (b, 1, 1, max_blocks * block_size) additive: 0 where a key exists, else -inf

    @property
    def num_decodes(self) -> int:
        return self.key_mask.shape[0]


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (N,) block * block_size + offset of each new token
    decode_rows: torch.Tensor  # (B,) rows of the decode tokens, group after group (SDPA path)
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    decode_kernel: NativeDecodeKernel | None = None  # set: the decodes are ``decode_batch``, not groups
    decode_batch: DecodeBatch | None = None


# Decodes are sorted by context length and attended in groups of at most this
# many, and of at most DECODE_GROUP_KEYS padded keys: padding every decode to
# the longest context of the step reads up to twice the keys there are;
# groups of similar lengths pad little. Each group gathers its own K/V just
# before its SDPA call, so the gathered KV (a few MB at most) is still in
# cache when attention reads it: one gather for the whole step writes tens
# of MB that attention then reads back from memory (measured 22 -> 15 ms
# per 32-decode step of the bench model, single thread; 2048 keys of its K
# and V are 2 MiB, the L2 of that machine; 1024 and 4096 were slower).
DECODE_GROUP_SIZE = 8
DECODE_GROUP_KEYS = 2048


def build_attention_metadata(
    sequences: list[SequenceSlice],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    decode_kernel: NativeDecodeKernel | None = None,
) -> AttentionMetadata:
    """Turn the step's sequences (in flattened order) into index tensors on ``device``.

    With ``decode_kernel`` (a CPU pool) the decodes are one ``DecodeBatch`` for it.
    Masks are additive in ``dtype`` (the model's): SDPA turns a bool mask into
    one on every call, i.e. per group per layer; this is once per step.
    """
    slots = _SlotMapping(block_size)
    decodes: list[tuple[int, int, list[int]]] = []  # (context_len, row, block table)
    prefills: list[PrefillChunk] = []
    query_start = 0
    for seq in sequences:
        context_len = seq.start_position + seq.num_query_tokens
        num_blocks = -(-context_len // block_size)
        if len(seq.block_ids) < num_blocks:
            raise ValueError(f"block table of {len(seq.block_ids)} blocks cannot hold {context_len} tokens")
        table = seq.block_ids[:num_blocks]
        slots.add(table, seq.start_position, context_len)
        if seq.num_query_tokens == 1:  # a decode, or a one-token chunk: same attention
            decodes.append((context_len, query_start, table))
        else:
            prefills.append(_prefill_chunk(seq, query_start, num_blocks, device, dtype))
        query_start += seq.num_query_tokens
    if decode_kernel is not None:
        batch = None
        if decodes:
            lengths, rows, tables = zip(*decodes)
            batch = DecodeBatch.build(list(rows), list(tables), list(lengths))
        empty = torch.empty(0, dtype=torch.long)
        return AttentionMetadata(slots.tensor(), empty, [], prefills, decode_kernel, batch)
    decodes.sort(key=lambda decode: decode[0])
    return AttentionMetadata(
        slot_mapping=slots.tensor().to(device),
        decode_rows=torch.tensor([row for _, row, _ in decodes], dtype=torch.long).to(device),
        decode_groups=_decode_groups(decodes, block_size, device, dtype),
        prefills=prefills,
    )


def _decode_groups(
    decodes: list[tuple[int, int, list[int]]], block_size: int, device: torch.device, dtype: torch.dtype
) -> list[DecodeGroup]:
    """The groups of the sorted ``decodes``."""
    if not decodes:
        return []
    # One mask and one block tensor for every decode, each group's a slice of them: a few ops per step.
    masks = _key_mask([length for length, _, _ in decodes], len(decodes[-1][2]) * block_size, dtype).to(device)
    shapes, decode_blocks = [], []  # (decodes, blocks per table) of each group; their padded tables
    for group in _group_decodes(decodes, block_size):
        width = len(group[-1][2])  # the longest table: the group is sorted by length
        shapes.append((len(group), width))
        for _, _, table in group:
            decode_blocks.extend(table + [0] * (width - len(table)))
    all_blocks = torch.tensor(decode_blocks, dtype=torch.long).to(device)
    groups, first_row, first_block = [], 0, 0
    for num_decodes, width in shapes:
        rows = slice(first_row, first_row + num_decodes)
        block_ids = all_blocks[first_block : first_block + num_decodes * width]
        key_mask = masks[rows, :, :, : width * block_size]  # (b, 1, 1, keys)
        groups.append(DecodeGroup(rows, block_ids, key_mask))
        first_row, first_block = rows.stop, first_block + num_decodes * width
    return groups


def _group_decodes(
    decodes: list[tuple[int, int, list[int]]], block_size: int
) -> list[list[tuple[int, int, list[int]]]]:
    """Split decodes sorted by context length into runs of at most DECODE_GROUP_SIZE
    decodes and DECODE_GROUP_KEYS padded keys (a lone longer decode is its own group)."""
    groups: list[list[tuple[int, int, list[int]]]] = []
    for decode in decodes:
        padded_keys = len(decode[2]) * block_size  # this decode is the longest so far
        if groups and len(groups[-1]) < DECODE_GROUP_SIZE and (len(groups[-1]) + 1) * padded_keys <= DECODE_GROUP_KEYS:
            groups[-1].append(decode)
        else:
            groups.append([decode])
    return groups


class _SlotMapping:
    """Cache slots (block * block_size + offset in block) of the step's tokens, in order.

    A chunk's slots are tensor arithmetic; a decode's single slot is a Python
    int, gathered with its neighbours into one tensor: a tensor per decode
    would double the metadata time of a 32-decode step.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.pieces: list[torch.Tensor] = []
        self.pending: list[int] = []  # slots of consecutive single tokens

    def add(self, table: list[int], start: int, end: int) -> None:
        if end - start == 1:
            self.pending.append(table[start // self.block_size] * self.block_size + start % self.block_size)
            return
        self._flush()
        positions = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[positions // self.block_size]
        self.pieces.append(blocks * self.block_size + positions % self.block_size)

    def tensor(self) -> torch.Tensor:
        self._flush()
        return torch.cat(self.pieces) if self.pieces else torch.empty(0, dtype=torch.long)  # (N,)

    def _flush(self) -> None:
        if self.pending:
            self.pieces.append(torch.tensor(self.pending, dtype=torch.long))
            self.pending = []


def _prefill_chunk(
    seq: SequenceSlice, query_start: int, num_blocks: int, device: torch.device, dtype: torch.dtype
) -> PrefillChunk:
    mask = None
    if seq.start_position > 0:
        context_len = seq.start_position + seq.num_query_tokens
        query_positions = torch.arange(seq.start_position, context_len).unsqueeze(1)  # (q, 1)
        hidden = torch.arange(context_len).unsqueeze(0) > query_positions  # (q, ctx): keys after the query
        mask = _additive(hidden, dtype).to(device)
    return PrefillChunk(
        query_start=query_start,
        num_query_tokens=seq.num_query_tokens,
        start_position=seq.start_position,
        block_ids=torch.tensor(seq.block_ids[:num_blocks], dtype=torch.long).to(device),
        causal_mask=mask,
    )


def _key_mask(context_lens: list[int], num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    lens = torch.tensor(context_lens, dtype=torch.long).unsqueeze(1)  # (B, 1)
    padding = torch.arange(num_keys).unsqueeze(0) >= lens  # (B, num_keys)
    return _additive(padding, dtype)[:, None, None, :]  # (B, 1, 1, num_keys): broadcast over heads and the query


def _additive(hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """-inf where ``hidden`` is true, 0 elsewhere: what SDPA makes of the inverse bool mask."""
    return torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf"))


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
    output = torch.empty_like(query)
    if metadata.decode_kernel is not None and metadata.decode_batch is not None:
        metadata.decode_kernel(query, key_cache, value_cache, metadata.decode_batch, output)
    elif metadata.decode_groups:
        decode_out = _decode_attention(query.index_select(0, metadata.decode_rows), key_cache, value_cache, metadata)
        output.index_copy_(0, metadata.decode_rows, decode_out)
    for chunk in metadata.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.num_query_tokens)
        output[rows] = _prefill_attention(query[rows], key[rows], value[rows], key_cache, value_cache, chunk)
    return output


def _decode_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata
) -> torch.Tensor:
    """query (B, H, D) in ``decode_rows`` order -> (B, H, D)."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    # The query heads of one KV head attend as that head's queries: K and V are read once for
    # them all (enable_gqa reads them once per query head; 10% slower per group, measured).
    queries = query.view(query.shape[0], num_kv_heads, -1, head_dim)  # (B, KVH, H / KVH, D)
    outputs = []
    for group in metadata.decode_groups:
        num_decodes, num_keys = group.num_decodes, group.key_mask.shape[-1]
        # The gathered (b * max_blocks, BS, KVH, D) blocks seen as (b, KVH, L, D): one call where
        # view + transpose are two, and this loop runs per group per layer.
        size = (num_decodes, num_kv_heads, num_keys, head_dim)
        stride = (num_keys * num_kv_heads * head_dim, head_dim, num_kv_heads * head_dim, 1)
        keys = key_cache.index_select(0, group.block_ids).as_strided(size, stride)
        values = value_cache.index_select(0, group.block_ids).as_strided(size, stride)
        outputs.append(F.scaled_dot_product_attention(queries[group.rows], keys, values, attn_mask=group.key_mask))
    return torch.cat(outputs).view(query.shape)  # (B, KVH, H / KVH, D) -> (B, H, D)


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
