"""Incremental detokenization and stop strings: token ids in, safe text out.

``IncrementalDetokenizer`` turns a growing list of token ids into text
deltas without ever emitting half a UTF-8 character: it decodes a short
window (vLLM's prefix/read offsets) and holds the tail back while it decodes
to U+FFFD, i.e. while a multi-byte character is still split across tokens.
The window starts a few tokens before the new ones so that tokenizers whose
decoding depends on context (SentencePiece's leading space) diff correctly.

``StopStringMatcher`` finds stop strings in that text across token
boundaries. It holds back the longest suffix that could still begin a stop
string, so a stop string never reaches the client, and cuts the text at the
earliest match.

Range table over ``token_ids`` (IncrementalDetokenizer)::

    [0, prefix_offset)              emitted, outside the decode window
    [prefix_offset, read_offset)    emitted, decoded again as context
    [read_offset, len)              not emitted yet (held while incomplete)
"""

from __future__ import annotations

from api.byte_detokenizer import ByteLevelDetokenizer
from api.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "make_detokenizer"]

_REPLACEMENT_CHAR = "\ufffd"
_CONTEXT_TOKENS = 5  # as vLLM: enough context for SentencePiece spacing


def make_detokenizer(tokenizer: Tokenizer, prompt_token_ids: list[int]) -> IncrementalDetokenizer | ByteLevelDetokenizer:
    """The request's detokenizer (special tokens skipped): the byte-table one
    (``api.byte_detokenizer``, O(1) per token) when the tokenizer has a table, else the generic one."""
    table = tokenizer.token_byte_table
    if table is not None:
        return ByteLevelDetokenizer(table)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids)


class IncrementalDetokenizer:
    __slots__ = ("_tokenizer", "_token_ids", "_prefix_offset", "_read_offset", "_skip_special_tokens")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self._token_ids = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)

    def add(self, new_token_ids: list[int]) -> str:
        """Text that the new tokens complete; may be empty while a character is split."""
        self._token_ids.extend(new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Everything still held back (the stream ended), incomplete bytes included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._token_ids):
            return ""
        decode = self._tokenizer.backend.decode
        skip = self._skip_special_tokens
        ids = self._token_ids
        prefix_text = decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        new_text = decode(ids[self._prefix_offset :], skip_special_tokens=skip)
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)):
            return ""
        delta = new_text[len(prefix_text) :]
        # Keep the window short: the next decode starts at the last emitted tokens.
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        if self._prefix_offset > 64:
            del ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta


class StopStringMatcher:
    __slots__ = ("_stops", "_held")

    def __init__(self, stop_strings: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stop_strings if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to emit, the stop string matched or None).

        After a match the text is cut before the stop string and the
        request is over; what followed it is dropped.
        """
        buffer = self._held + text
        if not buffer:
            return "", None
        match_at, matched = -1, None
        for stop in self._stops:
            index = buffer.find(stop)
            if index != -1 and (matched is None or index < match_at):
                match_at, matched = index, stop
        if matched is not None:
            self._held = ""
            return buffer[:match_at], matched
        hold = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], None

    def flush(self) -> str:
        """The held-back text, when the stream ended without a match."""
        held, self._held = self._held, ""
        return held

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
