"""A rendered chat prompt tokenized a segment at a time, the template's own segments looked up.

The ``tokenizers`` library cuts a text at its added tokens first (leftmost-longest), then
normalizes and pre-tokenizes each piece between them on its own. A rendered prompt is mostly
such pieces that the template wrote itself (``user``, ``assistant``, ``\\n\\n`` between
``<|start_header_id|>`` and ``<|end_header_id|>``); their ids are the same in every request.
``PromptSegments`` makes the same cut in Python, takes the added tokens' ids and the
template's pieces from tables built once per model, and asks the tokenizer only for the
rest (the messages' text): a third of the prompt's tokenizing, most of it the pre-tokenizer's
regex, which costs about 1 us a match. The ids of long pieces (a system prompt, an earlier
message) are kept by their text (``api.piece_cache``): a conversation's next turn
tokenizes only its new messages.

The tables hold only what the model's files fix (the template's literal text, the API's
roles), never a request's text. ``PromptSegments.of`` returns None for a tokenizer whose
pieces are not independent of each other (``encode_special_tokens``, truncation or padding,
an added token with ``lstrip``/``rstrip``/``single_word``/``normalized``, a Metaspace
pre-tokenizer that treats the first piece alone, a normalizer or model outside those
proven here: ``tests/frontends/test_prompt_segments.py``); the caller then encodes whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any

import jinja2
import tokenizers
from jinja2 import nodes

from api.piece_cache import MIN_CHARS, PieceCache

__all__ = ["PromptSegments", "template_literals"]

# The roles an API may put into a template (OpenAI's, Anthropic's, and Llama's tool header).
_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
_MAX_PIECE_CHARS = 256
_MAX_PIECES = 1024
# Components that work on each piece alone, wherever it sits in the text, each tried in the tests
# (Metaspace's prepend_scheme "first" does not).
_PIECEWISE_NORMALIZERS = frozenset({"NFC", "NFKC"})
_PIECEWISE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Digits"})
_PIECEWISE_MODELS = frozenset({"BPE"})


def _piecewise(config: dict[str, Any]) -> bool:
    normalizer, pre_tokenizer = config.get("normalizer"), config.get("pre_tokenizer")
    if config.get("truncation") is not None or config.get("padding") is not None:
        return False
    if normalizer is not None and normalizer.get("type") not in _PIECEWISE_NORMALIZERS:
        return False
    if pre_tokenizer is None:
        return False
    parts = pre_tokenizer.get("pretokenizers", [pre_tokenizer]) if pre_tokenizer.get("type") == "Sequence" \
        else [pre_tokenizer]
    return (all(part.get("type") in _PIECEWISE_PRE_TOKENIZERS for part in parts)
            and config.get("model", {}).get("type") in _PIECEWISE_MODELS)


def template_literals(environment: jinja2.Environment, source: str) -> list[str]:
    """The text a template writes as it is: its data between tags and its string constants."""
    tree = environment.parse(source)
    texts = [node.data for node in tree.find_all(nodes.TemplateData)]
    texts += [node.value for node in tree.find_all(nodes.Const) if isinstance(node.value, str)]
    return texts


class PromptSegments:
    """``encode(text)``: ``backend.encode(text, add_special_tokens=False).ids``, piece by piece."""

    __slots__ = ("_cut", "_token_ids", "_known", "_encode", "cache")

    def __init__(self, token_ids: dict[str, int], known: dict[str, list[int]],
                 encode: Callable[[str], list[int]], cache: PieceCache | None = None) -> None:
        # Longest first: at the leftmost match the alternation takes the longest token, as the
        # tokenizer's leftmost-longest automaton does (re moves a shared prefix such as "<|" out).
        alternatives = "|".join(re.escape(token) for token in sorted(token_ids, key=len, reverse=True))
        self._cut = re.compile(f"({alternatives})").split
        self._token_ids = token_ids
        self._known = known
        self._encode = encode
        self.cache = cache  # the ids of long pieces by their text; None: none kept

    @classmethod
    def of(cls, backend: tokenizers.Tokenizer, literals: Iterable[str],
           cache: PieceCache | None = None) -> PromptSegments | None:
        """For a tokenizer whose pieces tokenize alone (module doc), with the pieces of
        ``literals`` (a template's text) known and long pieces kept in ``cache``; else None."""
        if getattr(backend, "encode_special_tokens", False) or not _piecewise(json.loads(backend.to_str())):
            return None
        added = backend.get_added_tokens_decoder()
        if not added or any(token.lstrip or token.rstrip or token.single_word or token.normalized
                            or not token.content for token in added.values()):
            return None
        token_ids = {token.content: token_id for token_id, token in added.items()}

        def encode(text: str) -> list[int]:
            return backend.encode(text, add_special_tokens=False).ids

        segments = cls(token_ids, {}, encode, cache)
        pieces = {piece for text in (*literals, *_ROLES) for piece in segments._cut(text)[::2]
                  if piece and len(piece) <= _MAX_PIECE_CHARS}
        segments._known = {piece: encode(piece) for piece in sorted(pieces)[:_MAX_PIECES]}
        encode_fast = getattr(backend, "encode_batch_fast", None)  # tokenizers >= 0.20: no offsets
        if encode_fast is not None:  # one text a call: a batch of several costs more (its thread pool)
            segments._encode = lambda text: encode_fast([text], add_special_tokens=False)[0].ids
        return segments

    def encode(self, text: str) -> list[int]:
        known, encode, token_ids, cache = self._known, self._encode, self._token_ids, self.cache
        ids: list[int] = []
        is_token = False  # the cut alternates: piece, token, piece, ..., piece
        for part in self._cut(text):
            if is_token:
                ids.append(token_ids[part])
            elif part:
                piece_ids = known.get(part)
                if piece_ids is not None:
                    ids += piece_ids
                elif len(part) >= MIN_CHARS and cache is not None:
                    ids += _kept_or_encoded(cache, part, encode)
                else:
                    ids += encode(part)
            is_token = not is_token
        return ids


def _kept_or_encoded(cache: PieceCache, piece: str, encode: Callable[[str], list[int]]) -> Iterable[int]:
    kept = cache.get(piece)
    if kept is not None:
        return kept
    piece_ids = encode(piece)
    cache.put(piece, piece_ids)
    return piece_ids
