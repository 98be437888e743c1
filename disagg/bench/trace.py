"""Mooncake-format request traces: a window of one, its prompts as token ids, its prefix-cache ceiling.

A trace is JSON lines, one request each (the format of the Mooncake FAST'25 trace release)::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

``timestamp`` is the arrival in milliseconds from the start; ``hash_ids`` names the prompt's blocks
of ``trace_block`` tokens (512 in the release), so that equal ids at the same position are the same
tokens. Raw text is not part of a trace: each id becomes ``block_tokens`` token ids drawn from a
generator seeded by the id (``TokenMap``), so equal ids give equal tokens on every replay, and the
prompt is cut to the request's length scaled the same way. ``block_tokens`` below 512 shrinks every
prompt by the same factor and keeps the trace's sharing intact: what a small deployment (or a tiny
model's context) can replay.

The ceiling (``prefix_ceiling``) is what one infinite cache shared by every worker would hold: a
request's longest prefix of blocks that earlier requests of the window already sent. No cache and
no router can report more cached prompt tokens than that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

__all__ = ["TraceRequest", "TraceWindow", "TokenMap", "Ceiling", "load_trace", "parse_window", "prefix_ceiling",
           "TRACE_BLOCK_TOKENS"]

TRACE_BLOCK_TOKENS = 512
"""Tokens per hash id in the Mooncake release."""


class TraceRequest(msgspec.Struct, frozen=True):
    timestamp: float
    """Milliseconds from the trace's start."""
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass(frozen=True)
class TraceWindow:
    """Seconds of the trace to replay, ``[start, end)``; ``end`` None: to the end of the trace."""

    start: float = 0.0
    end: float | None = None

    def __str__(self) -> str:
        return f"{self.start:g}:{'' if self.end is None else f'{self.end:g}'}"


def parse_window(text: str | None) -> TraceWindow:
    """``START:END`` in seconds, either side may be empty; ValueError naming --window otherwise."""
    if not text:
        return TraceWindow()
    start_text, colon, end_text = text.partition(":")
    try:
        start = float(start_text) if start_text.strip() else 0.0
        end = float(end_text) if end_text.strip() else None
    except ValueError:
        raise ValueError(f"--window: expected START:END in seconds (e.g. 0:300), got {text!r}") from None
    if not colon or start < 0 or (end is not None and end <= start):
        raise ValueError(f"--window: expected START:END in seconds with 0 <= START < END, got {text!r}")
    return TraceWindow(start, end)


_decoder = msgspec.json.Decoder(TraceRequest)


def load_trace(path: str | Path, window: TraceWindow = TraceWindow(), limit: int | None = None
               ) -> list[TraceRequest]:
    """The requests of ``path`` that arrive inside ``window`` (at most ``limit``), in arrival order,
    their timestamps made relative to the window's start; ValueError naming the file and line."""
    requests: list[TraceRequest] = []
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as exc:
        raise ValueError(f"--trace: cannot read {path}: {exc.strerror or exc}") from None
    start_ms, end_ms = window.start * 1e3, math.inf if window.end is None else window.end * 1e3
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            request = _decoder.decode(line)
        except msgspec.DecodeError as exc:
            raise ValueError(f"--trace: {path}:{number}: not a trace request ({exc})") from None
        if request.input_length < 1 or request.output_length < 1 or not request.hash_ids:
            raise ValueError(f"--trace: {path}:{number}: input_length, output_length and hash_ids must be "
                             "non-empty")
        if start_ms <= request.timestamp < end_ms:
            requests.append(msgspec.structs.replace(request, timestamp=request.timestamp - start_ms))
            if limit is not None and len(requests) >= limit:
                break
    if not requests:
        raise ValueError(f"--trace: {path}: no request arrives in the window {window}")
    requests.sort(key=lambda r: r.timestamp)
    return requests


@dataclass(frozen=True)
class TokenMap:
    """Token ids for a trace's hash ids: ``block_tokens`` ids per hash id, drawn from ``[low, high)``
    by a generator seeded with (``seed``, id), so equal ids give equal tokens in any replay."""

    block_tokens: int = TRACE_BLOCK_TOKENS
    trace_block: int = TRACE_BLOCK_TOKENS
    low: int = 100
    high: int = 500
    seed: int = 0

    def prompt_length(self, request: TraceRequest) -> int:
        """The request's prompt length at this map's scale: ``input_length`` × block_tokens / trace_block,
        at most the tokens of its blocks, at least one."""
        scaled = math.ceil(request.input_length * self.block_tokens / self.trace_block)
        return max(1, min(scaled, len(request.hash_ids) * self.block_tokens))

    def block(self, hash_id: int) -> list[int]:
        rng = np.random.default_rng([self.seed, hash_id])
        return rng.integers(self.low, self.high, self.block_tokens).tolist()

    def prompt(self, request: TraceRequest, blocks: dict[int, list[int]]) -> list[int]:
        """The prompt's token ids; ``blocks`` memoizes each id's tokens across requests."""
        ids: list[int] = []
        for hash_id in request.hash_ids:
            tokens = blocks.get(hash_id)
            if tokens is None:
                tokens = blocks[hash_id] = self.block(hash_id)
            ids += tokens
        return ids[:self.prompt_length(request)]


@dataclass(frozen=True)
class Ceiling:
    """What one infinite shared cache would hold of the window's prompts."""

    blocks: float
    """Fraction of all prompt blocks inside a prefix earlier requests sent (0.366 over the whole release)."""
    tokens: float
    """The same, in prompt tokens at the replay's scale: what the usage's cached tokens are compared with."""


def prefix_ceiling(requests: list[TraceRequest], token_map: TokenMap) -> Ceiling:
    seen: set[int] = set()
    num_blocks = cached_blocks = num_tokens = cached_tokens = 0
    for request in requests:
        prefix = 0
        for hash_id in request.hash_ids:
            if hash_id not in seen:
                break
            prefix += 1
        seen.update(request.hash_ids)
        length = token_map.prompt_length(request)
        num_blocks, cached_blocks = num_blocks + len(request.hash_ids), cached_blocks + prefix
        num_tokens, cached_tokens = num_tokens + length, cached_tokens + min(prefix * token_map.block_tokens, length)
    return Ceiling(cached_blocks / num_blocks, cached_tokens / num_tokens)
