"""The byte-table detokenizer gives the generic detokenizer's text (``backend.decode``) at O(1) per token."""

from __future__ import annotations

import random

import pytest
import tokenizers
from tokenizers import models

from api.byte_detokenizer import ByteLevelDetokenizer, token_byte_table
from api.detokenizer import IncrementalDetokenizer, make_detokenizer
from api.tokenizer import Tokenizer

TEXTS = ["Café 你好，世界！ 😀 🚀 done", "plain ascii, with  spaces\nand lines", "ok 😀"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


def streamed(detokenizer, token_ids: list[int], sizes: list[int]) -> list[str]:
    pieces, at = [], 0
    for size in sizes:
        pieces.append(detokenizer.add(token_ids[at:at + size]))
        at += size
    return pieces + [detokenizer.flush()]


def test_byte_level_tokenizers_get_a_table_and_requests_the_fast_detokenizer(tokenizer):
    table = tokenizer.token_byte_table
    assert table is not None and len(table) == tokenizer.vocab_size
    assert table[tokenizer.eos_token_id] == b""  # special tokens are skipped
    assert isinstance(make_detokenizer(tokenizer, [1, 2]), ByteLevelDetokenizer)


@pytest.mark.parametrize("text", TEXTS)
def test_same_text_as_the_generic_detokenizer_token_by_token(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    fast = streamed(make_detokenizer(tokenizer, []), ids, [1] * len(ids))
    generic = streamed(IncrementalDetokenizer(tokenizer, []), ids, [1] * len(ids))
    assert "".join(fast) == "".join(generic) == text
    assert all("\ufffd" not in piece for piece in fast)


def test_random_ids_in_random_chunks_decode_as_the_whole_sequence(tokenizer):
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(tokenizer.vocab_size + 8) for _ in range(rng.randrange(1, 24))]  # some past the vocab
        sizes = []
        while sum(sizes) < len(ids):
            sizes.append(min(rng.randrange(1, 5), len(ids) - sum(sizes)))
        fast = "".join(streamed(make_detokenizer(tokenizer, []), ids, sizes))
        assert fast == tokenizer.backend.decode(ids, skip_special_tokens=True)


def test_incomplete_character_is_held_then_flushed_as_a_replacement(tokenizer):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]  # the emoji's last byte never comes
    detokenizer = make_detokenizer(tokenizer, [])
    emitted = "".join(detokenizer.add([i]) for i in ids)
    assert "\ufffd" not in emitted
    assert emitted + detokenizer.flush() == tokenizer.decode(ids)


def test_other_tokenizers_keep_the_generic_detokenizer():
    word_level = tokenizers.Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    assert token_byte_table(word_level) is None


def test_a_non_special_added_token_keeps_the_generic_detokenizer(tiny_model_dir):
    backend = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert token_byte_table(backend) is not None
    backend.add_tokens(["<tool_call>"])
    assert token_byte_table(backend) is None


def test_random_ids_token_by_token_give_the_generic_detokenizers_events(tokenizer):
    rng = random.Random(11)
    for _ in range(300):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 24))]
        fast = streamed(make_detokenizer(tokenizer, []), ids, [1] * len(ids))
        generic = streamed(IncrementalDetokenizer(tokenizer, []), ids, [1] * len(ids))
        assert fast == generic, ids
