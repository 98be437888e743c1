"""A sequence's DeepSeek-V4 state cut into per-block payloads, and put back together: the KV transfer.

Block ``b`` of a sequence of ``n`` tokens carries what its positions
``[b * block_size, (b + 1) * block_size)`` added that the next forward still reads:

- the rows of the sliding window at those positions (the window holds the last
  ``sliding_window - 1`` positions: earlier blocks carry none);
- per compressor (CSA/HCA, and the CSA indexer's own), the entries whose window
  closes in the block: entry ``w`` covers tokens ``[w * rate, (w + 1) * rate)`` and
  closes at its last token, so block ``b`` holds entries ``[b*bs // rate, (b+1)*bs // rate)``;
- the block holding the last token (``(n - 1) // block_size``) also carries every
  compressor's open tail and CSA overlap series (state.py), which span blocks.

That is the layout docs/deepseek_v4.md designs for the paged pool; here it is cut from
and assembled into the per-sequence ``SequenceState`` the runner keeps. One msgpack
frame per block (typed msgspec, no pickle); tensors as raw float32 bytes whose row
counts the assembly checks against ``n``, so a frame from another model or block size
is refused with a ValueError, never loaded.
"""

from __future__ import annotations

import msgspec
import torch

from workers.engine.model.deepseek_v4.config import AttentionKind, DeepseekV4Config
from workers.engine.model.deepseek_v4.state import CompressorState, SequenceState

__all__ = ["BlockPayload", "assemble_state", "check_payload", "decode_payload", "encode_block"]


class CompressorPart(msgspec.Struct, array_like=True, frozen=True):
    entries: bytes
    # The open tail and the overlap series: only in the sequence's last block.
    tail_kv: bytes | None = None
    tail_gate: bytes | None = None
    overlap_kv: bytes | None = None
    overlap_gate: bytes | None = None


class LayerPart(msgspec.Struct, array_like=True, frozen=True):
    window: bytes
    compressor: CompressorPart | None = None
    indexer: CompressorPart | None = None


class BlockPayload(msgspec.Struct, array_like=True, frozen=True):
    index: int  # the block's place in its sequence's table
    num_tokens: int  # the sequence's tokens when it was cut (every block of one export agrees)
    block_size: int
    layers: list[LayerPart]


_decoder = msgspec.msgpack.Decoder(BlockPayload)


def encode_block(state: SequenceState, index: int, block_size: int, config: DeepseekV4Config) -> bytes:
    """Block ``index``'s share of ``state`` as one frame."""
    n = state.num_tokens
    start, end = index * block_size, (index + 1) * block_size
    last = n > 0 and index == (n - 1) // block_size
    layers = []
    for kind, layer in zip(config.layer_kinds, state.layers):
        window_start = n - layer.window.shape[0]  # the window's first position
        rows = layer.window[max(start, window_start) - window_start : max(min(end, n), window_start) - window_start]
        rate = config.compress_rate(kind) if kind is not AttentionKind.SLIDING else 1
        entries = slice(start // rate, end // rate)
        layers.append(
            LayerPart(
                _bytes(rows),
                _compressor_part(layer.compressor, entries, last),
                _compressor_part(layer.indexer, entries, last),
            )
        )
    return msgspec.msgpack.encode(BlockPayload(index, n, block_size, layers))


def decode_payload(frame: bytes | memoryview) -> BlockPayload:
    """ValueError on anything but a block payload."""
    try:
        return _decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raise ValueError(f"deepseek_v4: not a KV block payload ({exc})") from exc


def check_payload(payload: BlockPayload, config: DeepseekV4Config, block_size: int) -> None:
    """ValueError unless ``payload`` is exactly what ``encode_block`` gives for its block of a sequence
    of this model and block size: checked on arrival, so a foreign frame fails the pull (and the gen
    engine prefills instead) rather than the step that would assemble it."""
    n, start, end = payload.num_tokens, payload.index * block_size, (payload.index + 1) * block_size
    if payload.block_size != block_size:
        raise ValueError(f"deepseek_v4: KV blocks of block size {payload.block_size}, this engine's is {block_size}")
    if not 0 <= start < n or len(payload.layers) != config.num_layers:
        raise ValueError(f"deepseek_v4: KV block {payload.index} of {n} tokens and {len(payload.layers)} layers does "
                         f"not belong to this {config.num_layers}-layer model")
    last = payload.index == (n - 1) // block_size
    window_start = n - min(n, config.sliding_window - 1)
    window_rows = max(0, min(end, n) - max(start, window_start))
    for kind, part in zip(config.layer_kinds, payload.layers):
        _check_rows(part.window, config.head_dim, window_rows, "window")
        expected = ((config.head_dim, part.compressor, kind is not AttentionKind.SLIDING),
                    (config.index_head_dim, part.indexer, kind is AttentionKind.CSA))
        for dim, piece, present in expected:
            if (piece is not None) != present:
                raise ValueError(f"deepseek_v4: KV block {payload.index} has the wrong compressors for a {kind} layer")
            if piece is None:
                continue
            rate = config.compress_rate(kind)
            overlap = kind is AttentionKind.CSA
            total = n // rate
            _check_rows(piece.entries, dim, min(end // rate, total) - min(start // rate, total), "entries")
            tails = (piece.tail_kv, piece.tail_gate)
            overlaps = (piece.overlap_kv, piece.overlap_gate)
            if not last:
                if any(t is not None for t in (*tails, *overlaps)):
                    raise ValueError(f"deepseek_v4: KV block {payload.index} is not the last but has a tail")
                continue
            width = 2 * dim if overlap else dim
            for tail in tails:
                _check_rows(tail, width, n % rate, "tail")
            for series in overlaps:
                if overlap and n >= rate:
                    _check_rows(series, dim, rate, "overlap")
                elif series is not None:
                    raise ValueError(f"deepseek_v4: KV block {payload.index} has an overlap series it cannot have")


def _check_rows(data: bytes | None, dim: int, rows: int, what: str) -> None:
    if data is None or len(data) != rows * dim * 4:
        size = "none" if data is None else f"{len(data)} bytes"
        raise ValueError(f"deepseek_v4: a KV block's {what} holds {size} where {rows} rows of {dim} float32 belong")


def assemble_state(payloads: list[BlockPayload], config: DeepseekV4Config, block_size: int) -> SequenceState:
    """The state of a sequence from its blocks' payloads, in table order (every block up to its last
    token's). ValueError when they do not make one whole, consistent state of this model."""
    if not payloads:
        raise ValueError("deepseek_v4: no KV blocks to assemble")
    n = payloads[0].num_tokens
    expected_blocks = -(-n // block_size)
    if [p.index for p in payloads] != list(range(len(payloads))) or len(payloads) != expected_blocks:
        raise ValueError(f"deepseek_v4: KV blocks {[p.index for p in payloads]} are not the {expected_blocks} "
                         f"blocks of a {n}-token sequence")
    if any(p.num_tokens != n or p.block_size != block_size or len(p.layers) != config.num_layers for p in payloads):
        raise ValueError("deepseek_v4: KV blocks of another sequence, block size or model")
    state = SequenceState.empty(config)
    state.num_tokens = n
    for index, (kind, layer) in enumerate(zip(config.layer_kinds, state.layers)):
        parts = [p.layers[index] for p in payloads]
        layer.window = _rows([p.window for p in parts], config.head_dim, min(n, config.sliding_window - 1))
        if kind is AttentionKind.SLIDING:
            continue
        rate = config.compress_rate(kind)
        overlap = kind is AttentionKind.CSA
        layer.compressor = _compressor([p.compressor for p in parts], config.head_dim, rate, overlap, n)
        if kind is AttentionKind.CSA:
            layer.indexer = _compressor([p.indexer for p in parts], config.index_head_dim, rate, overlap, n)
    return state


def _compressor_part(state: CompressorState | None, entries: slice, last: bool) -> CompressorPart | None:
    if state is None:
        return None
    return CompressorPart(
        _bytes(state.entries[entries]),
        _bytes(state.tail_kv) if last else None,
        _bytes(state.tail_gate) if last else None,
        _bytes(state.overlap_kv) if last and state.overlap_kv is not None else None,
        _bytes(state.overlap_gate) if last and state.overlap_gate is not None else None,
    )


def _compressor(parts: list[CompressorPart | None], dim: int, rate: int, overlap: bool, n: int) -> CompressorState:
    if any(p is None for p in parts):
        raise ValueError("deepseek_v4: a KV block lacks a compressed layer's entries")
    present = [p for p in parts if p is not None]
    width = 2 * dim if overlap else dim
    last = present[-1]
    if last.tail_kv is None or last.tail_gate is None:
        raise ValueError("deepseek_v4: the last KV block lacks the compressor's tail")
    state = CompressorState(
        _rows([p.entries for p in present], dim, n // rate),
        _rows([last.tail_kv], width, n % rate),
        _rows([last.tail_gate], width, n % rate),
    )
    if overlap and n >= rate:
        if last.overlap_kv is None or last.overlap_gate is None:
            raise ValueError("deepseek_v4: the last KV block lacks the CSA overlap series")
        state.overlap_kv = _rows([last.overlap_kv], dim, rate)
        state.overlap_gate = _rows([last.overlap_gate], dim, rate)
    return state


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().to(torch.float32).contiguous().numpy().tobytes()


def _rows(chunks: list[bytes], dim: int, expected_rows: int) -> torch.Tensor:
    data = b"".join(chunks)
    if len(data) != expected_rows * dim * 4:
        raise ValueError(f"deepseek_v4: KV blocks hold {len(data)} bytes where {expected_rows} rows of {dim} "
                         f"float32 belong")
    if not data:
        return torch.zeros(0, dim)
    return torch.frombuffer(bytearray(data), dtype=torch.float32).view(expected_rows, dim).clone()
