"""The tokenizer a GGUF file describes (``tokenizer.ggml.*``), as a ``tokenizers.Tokenizer``.

A GGUF carries no ``tokenizer.json``: the vocabulary, the merges, each
token's type and the special token ids are metadata. This rebuilds the
byte-level BPE (``tokenizer.ggml.model == "gpt2"``) exactly as transformers
does for the same file (``from_pretrained(dir, gguf_file=...)``), which a test
checks token for token: GPT-2's byte-level pre-tokenizer and decoder, the
control tokens (type 3) added as special tokens, user-defined ones (type 4)
as plain added tokens. Torch-free (``gguf`` reads with numpy): the frontends'
``Tokenizer`` and the engine's grammar compiler (``workers.guided``) both use it.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

__all__ = ["GGUFTokenizerError", "tokenizer_from_gguf"]

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
_SPECIAL_TOKEN_IDS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                      "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}


class GGUFTokenizerError(ValueError):
    """The file's tokenizer is missing or of a kind this builder does not rebuild."""


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character table (``bytes_to_unicode``).
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def tokenizer_from_gguf(path: str | Path) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """The backend tokenizer and a ``tokenizer_config.json``-shaped dict (special tokens, chat
    template, ``add_bos_token``, ``model_max_length``) of the GGUF file ``path``."""
    from workers.engine.model.gguf_metadata import gguf_context_length, gguf_field, open_gguf

    reader = open_gguf(path)
    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFTokenizerError(f"{path}: tokenizer.ggml.model {kind!r} is not supported; supported: 'gpt2' "
                                 "(byte-level BPE)")
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    merges: list[str] = gguf_field(reader, "tokenizer.ggml.merges") or []
    token_types: list[int] = gguf_field(reader, "tokenizer.ggml.token_type") or []
    backend = _byte_level_bpe(tokens, merges, token_types)
    config: dict[str, Any] = {
        "chat_template": gguf_field(reader, "tokenizer.chat_template"),
        "add_bos_token": bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "model_max_length": gguf_context_length(reader),
    }
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = gguf_field(reader, key)
        config[name] = tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None
    if config["add_bos_token"] and config["bos_token"] is not None:
        bos = config["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    return backend, config


def _merge_pair(merge: str) -> tuple[str, str]:
    """A GGUF merge ``"left right"`` as the pair tokenizers' BPE takes (byte-level tokens hold no space)."""
    parts = merge.split(" ")
    if len(parts) != 2:
        raise ValueError(f"a GGUF merge must be two tokens separated by a space, got {merge!r}")
    return parts[0], parts[1]


def _byte_level_bpe(tokens: list[str], merges: list[str], token_types: list[int]) -> tokenizers.Tokenizer:
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # A token outside the byte alphabet (a raw UTF-8 spelling some converters write) is respelled.
    vocab = {token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode("utf-8")): index
             for index, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=[_merge_pair(merge) for merge in merges], dropout=None,
        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|endoftext|>) match whole and are special (skipped when decoding);
    # one spelled outside the byte alphabet is a llama.cpp mislabel, left alone as transformers does.
    typed = list(zip(tokens, token_types))
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                for token, kind in typed if kind == _CONTROL and set(token) <= spelled])
    backend.add_tokens([AddedToken(token, normalized=False, special=False)
                        for token, kind in typed if kind == _USER_DEFINED and token in vocab])
    return backend
