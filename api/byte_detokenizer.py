"""Detokenization that never rescans: each token's bytes looked up, UTF-8 decoded incrementally.

For a tokenizer whose decoder is byte-level BPE alone (GPT-2, Llama 3, SmolLM2,
Qwen2: ``"decoder": {"type": "ByteLevel"}``), ``backend.decode(ids,
skip_special_tokens=True)`` is exactly the UTF-8 decoding (errors replaced)
of the concatenated bytes of the ids' tokens, special tokens contributing
none. So a table from token id to bytes, built once per tokenizer, and one
request's incremental UTF-8 decoding give the same text as the generic
``IncrementalDetokenizer`` (which decodes a window of ids twice per step) at
O(1) per token: a complete character goes out at once, an incomplete one is
held until its last byte arrives (or the stream ends: then it is U+FFFD, as
a whole-sequence decode would give).

A tokenizer with a token the table cannot map (a non-special added token,
whose text does not go through the byte alphabet) gets no table: its requests
use the generic detokenizer.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tokenizers

__all__ = ["ByteLevelDetokenizer", "token_byte_table"]

_REPLACEMENT_CHAR = "\ufffd"
_utf8_decode = codecs.utf_8_decode  # (data, errors, final) -> (text, bytes consumed)

def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-unicode map, inverted: the character each byte is written as -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars)}


def token_byte_table(backend: tokenizers.Tokenizer) -> tuple[bytes, ...] | None:
    """Each token id's bytes (b"" for special tokens); None when the tokenizer's decoder is
    not plain byte-level BPE or a token's text is not in the byte alphabet."""
    config = json.loads(backend.to_str())
    decoder = config.get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        return None
    added = {token["id"]: token for token in config.get("added_tokens", [])}
    alphabet = _byte_alphabet()
    table: list[bytes] = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        token = added.get(token_id)
        if token is not None and token.get("special"):
            table.append(b"")
            continue
        text = backend.id_to_token(token_id)
        if token is not None or text is None or any(char not in alphabet for char in text):
            return None
        table.append(bytes(alphabet[char] for char in text))
    return tuple(table)


class ByteLevelDetokenizer:
    """``IncrementalDetokenizer``'s interface (``add``, ``flush``) over a token byte table."""

    __slots__ = ("_table", "_split", "_held_text")

    def __init__(self, table: Sequence[bytes]) -> None:
        self._table = table
        # A split character's first bytes, until its last arrives: the state of an incremental UTF-8
        # decoder, kept here, so a token costs one C call, not the codec object's Python methods.
        self._split = b""
        self._held_text = ""

    def add(self, new_token_ids: list[int]) -> str:
        """Text that the new tokens complete; empty while a character is split.

        As the generic detokenizer, nothing goes out while a character is split,
        not even the complete ones before it: the same events for the same tokens.
        (A stray byte's U+FFFD stays in the text, as in a whole-sequence decode.)"""
        table = self._table
        try:
            data = table[new_token_ids[0]] if len(new_token_ids) == 1 else b"".join(
                [table[token_id] for token_id in new_token_ids])
        except IndexError:  # a model row past the tokenizer's vocabulary: decode() drops those ids
            data = b"".join([table[token_id] for token_id in new_token_ids if token_id < len(table)])
        if not self._split and data.isascii():
            # The common token: ASCII after complete characters decodes to itself (and leaves no
            # split character): two C calls.
            text = data.decode("ascii")
        else:  # codecs.BufferedIncrementalDecoder.decode's steps
            data = self._split + data
            text, consumed = _utf8_decode(data, "replace", False)
            self._split = data[consumed:]
        if not text:  # nothing new (a special token, a character's first bytes): what is held stays held
            return ""
        # Held while a character is split or the text ends in U+FFFD (a stray byte that a later
        # token may still explain), as the generic detokenizer holds it.
        if self._split or text.endswith(_REPLACEMENT_CHAR):
            self._held_text += text
            return ""
        if self._held_text:
            text, self._held_text = self._held_text + text, ""
        return text

    def flush(self) -> str:
        """Everything still held back (the stream ended), an incomplete character as U+FFFD."""
        text, self._held_text = self._held_text + _utf8_decode(self._split, "replace", True)[0], ""
        self._split = b""
        return text
