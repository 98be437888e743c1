"""Stream marks: which output tokens each write of a streamed answer carried (for migration).

A streamed gen leg that the orchestrator may migrate (``orchestrator.migration``) is sent
with the header ``x-disagg-stream-marks: 1``. The worker then ends every write of its
event stream with one SSE comment event, a mark::

    : disagg {"tokens":[523,11,87]}\\n\\n       the output tokens consumed since the last mark
    : disagg {"tokens":[],"error":503}\\n\\n    the write was the stream's error event (its status)

The tokens are all those the frontend consumed (detokenized, fed to the stop strings and the
tool-call parser) up to that write, held-back ones included, so that replaying exactly them
on another worker (a ``resume`` leg) puts its frontend in the state this one was in right
after the write. The orchestrator strips the marks (``MarkReader``) and relays only whole
writes: the client never holds half of one, and never sees a mark. An SSE client that meets
one anyway ignores it (a comment line).

Torch-free; the orchestrator imports this module.
"""

from __future__ import annotations

from contextvars import ContextVar

import msgspec

__all__ = ["MARKS_HEADER", "STREAM_MARKS", "StreamMark", "encode_mark", "MarkReader"]

MARKS_HEADER = "x-disagg-stream-marks"
STREAM_MARKS: ContextVar[bool] = ContextVar("disagg_stream_marks", default=False)
"""Set where a request enters a worker (``api.request_context``): its stream writes marks."""

_PREFIX = b": disagg "
_LINE = b"\n" + _PREFIX  # a mark starts a line (data lines are JSON: no raw newline inside)


class StreamMark(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    tokens: list[int] = []
    error: int | None = None
    """The write was the stream's error event, with this HTTP status (5xx: the worker failed)."""


_DECODER = msgspec.json.Decoder(StreamMark)


def encode_mark(mark: StreamMark) -> bytes:
    return _PREFIX + msgspec.json.encode(mark) + b"\n\n"


class MarkReader:
    """The orchestrator's side: bytes of a marked stream in, whole writes (marks stripped) with
    their marks out. What follows the last mark waits until its own mark comes."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[tuple[bytes, StreamMark]]:
        """The writes ``data`` completes, each with its mark, in order."""
        buffer = self._buffer + data if self._buffer else data
        writes: list[tuple[bytes, StreamMark]] = []
        start = 0
        while True:
            if buffer.startswith(_PREFIX, start):  # a mark right at a write's start (no events before it)
                at = start - 1
            else:
                at = buffer.find(_LINE, start)
                if at < 0:
                    break
            end = buffer.find(b"\n\n", at + 1 + len(_PREFIX))
            if end < 0:
                break
            try:
                mark = _DECODER.decode(buffer[at + 1 + len(_PREFIX):end])
            except msgspec.DecodeError:
                mark = StreamMark()  # never from our workers: relay the write, carry nothing
            writes.append((buffer[start:at + 1], mark))
            start = end + 2
        self._buffer = buffer[start:]
        return writes

    def rest(self) -> bytes:
        """What came after the last mark (a stream's unmarked end); the reader is empty after."""
        rest, self._buffer = self._buffer, b""
        return rest
