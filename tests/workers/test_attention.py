"""paged_attention against plain per-sequence attention, for a step mixing decodes and prefill chunks."""

from __future__ import annotations

import random

import torch

from workers.engine import attention
from workers.engine.attention import DECODE_GROUP_SIZE, SequenceSlice, build_attention_metadata, paged_attention

BLOCK_SIZE = 4
NUM_BLOCKS = 96
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8


def reference_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """query (q, H, D) at positions [start, start + q); keys/values (start + q, KVH, D) -> (q, H, D)."""
    group = NUM_HEADS // NUM_KV_HEADS
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)  # (ctx, H, D)
    scores = torch.einsum("qhd,khd->hqk", query, keys) / HEAD_DIM**0.5  # (H, q, ctx)
    positions = torch.arange(start, start + query.shape[0]).unsqueeze(1)  # (q, 1)
    scores = scores.masked_fill(torch.arange(keys.shape[0]).unsqueeze(0) > positions, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)


def test_mixed_step_matches_per_sequence_attention():
    rng = random.Random(0)
    torch.manual_seed(0)
    # More decodes than one group holds, in an order that is not sorted by length,
    # with prefill chunks between them: the groups must put every row back in place.
    shapes = [(rng.randint(1, 40), 1) for _ in range(DECODE_GROUP_SIZE + 5)]
    shapes[3:3] = [(0, 7)]  # a prompt's first chunk
    shapes[9:9] = [(13, 6)]  # a later chunk of a longer prompt
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    sequences, histories = [], []
    for start, num_query in shapes:
        num_blocks = -(-(start + num_query) // BLOCK_SIZE)
        sequences.append(SequenceSlice(start, num_query, [free.pop() for _ in range(num_blocks)]))
        history = torch.randn(2, start, NUM_KV_HEADS, HEAD_DIM)  # K and V of the positions before the step
        histories.append(history)
    key_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    value_cache = torch.zeros_like(key_cache)
    for seq, history in zip(sequences, histories):
        for position in range(seq.start_position):
            block, offset = seq.block_ids[position // BLOCK_SIZE], position % BLOCK_SIZE
            key_cache[block, offset], value_cache[block, offset] = history[0, position], history[1, position]

    num_tokens = sum(seq.num_query_tokens for seq in sequences)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    metadata = build_attention_metadata(sequences, BLOCK_SIZE, torch.device("cpu"))
    output = paged_attention(query, key, value, key_cache, value_cache, metadata)

    assert len(metadata.decode_groups) == 2
    row = 0
    for seq, history in zip(sequences, histories):
        rows = slice(row, row + seq.num_query_tokens)
        keys = torch.cat([history[0], key[rows]])  # (ctx, KVH, D)
        values = torch.cat([history[1], value[rows]])
        expected = reference_attention(query[rows], keys, values, seq.start_position)
        torch.testing.assert_close(output[rows], expected, rtol=0, atol=1e-5)
        row += seq.num_query_tokens


def test_decode_groups_respect_the_padded_key_budget(monkeypatch):
    monkeypatch.setattr(attention, "DECODE_GROUP_KEYS", 48)
    rng = random.Random(1)
    torch.manual_seed(1)
    lengths = [rng.randint(1, 30) for _ in range(12)] + [40]  # the last alone exceeds the budget
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    sequences = [SequenceSlice(n - 1, 1, [free.pop() for _ in range(-(-n // BLOCK_SIZE))]) for n in lengths]
    key_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    value_cache = torch.randn_like(key_cache)
    query = torch.randn(len(sequences), NUM_HEADS, HEAD_DIM)
    key = torch.randn(len(sequences), NUM_KV_HEADS, HEAD_DIM)
    value = torch.randn(len(sequences), NUM_KV_HEADS, HEAD_DIM)
    metadata = build_attention_metadata(sequences, BLOCK_SIZE, torch.device("cpu"))
    output = paged_attention(query, key, value, key_cache, value_cache, metadata)

    shapes = [tuple(group.key_mask.shape[::3]) for group in metadata.decode_groups]  # (decodes, padded keys)
    assert sum(b for b, _ in shapes) == len(sequences)
    assert all(b * keys <= 48 or b == 1 for b, keys in shapes)
    assert shapes[-1] == (1, 40)
    assert len(shapes) > -(-len(sequences) // attention.DECODE_GROUP_SIZE)  # the budget, not the count, split them
    for row, seq in enumerate(sequences):
        positions = range(seq.start_position + 1)
        slots = [(seq.block_ids[p // BLOCK_SIZE], p % BLOCK_SIZE) for p in positions]
        keys = torch.stack([key_cache[b, o] for b, o in slots])  # (ctx, KVH, D), this step's K already stored
        values = torch.stack([value_cache[b, o] for b, o in slots])
        expected = reference_attention(query[row : row + 1], keys, values, seq.start_position)
        torch.testing.assert_close(output[row : row + 1], expected, rtol=0, atol=1e-5)
