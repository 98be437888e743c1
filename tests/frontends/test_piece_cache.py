"""Long chat pieces tokenized once and kept by their text (api.piece_cache)."""

from __future__ import annotations

import random
import sys

import pytest

from api.metric_batch import MetricBatch
from api.piece_cache import MIN_CHARS, PieceCache, count_lookups
from api.prompt_segments import PromptSegments
from api.tokenizer import Tokenizer
from workers.engine.model.tiny_tokenizer import CHAT_TEMPLATE

_FRAGMENTS = ("Tell", " me", " a story.", " ", "\n", "\n\n", "user", "assistant", "<|", "|>", "_id",
              "é", "中文", "😀", "12345", "{\"name\": \"x\"}", "don't")


@pytest.fixture
def tiny(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)  # a fresh one each test: its own cache


def _long_text(rng: random.Random, chars: int) -> str:
    parts: list[str] = []
    while sum(map(len, parts)) < chars:
        parts.append(rng.choice(_FRAGMENTS))
    return "".join(parts)


def _entry_bytes(text: str, num_ids: int) -> int:
    return sys.getsizeof(text) + 4 * num_ids


def test_least_recently_used_pieces_leave_first_within_the_budget():
    a, b, c = "a" * 600, "b" * 600, "c" * 600
    cache = PieceCache(budget_bytes=2 * _entry_bytes(a, 10) + 1)
    cache.put(a, list(range(10)))
    cache.put(b, list(range(10)))
    assert list(cache.get(a) or []) == list(range(10))  # a is now the most recently used
    cache.put(c, list(range(10, 20)))  # over budget: b leaves, not a
    assert cache.get(b) is None and cache.get(a) is not None and list(cache.get(c) or []) == list(range(10, 20))
    assert len(cache) == 2 and cache.num_bytes == 2 * _entry_bytes(a, 10) <= cache.budget_bytes
    assert (cache.hits, cache.misses) == (3, 1)


def test_replacing_a_piece_and_refusing_one_larger_than_the_budget_keep_the_books():
    cache = PieceCache(budget_bytes=_entry_bytes("x" * 600, 100))
    cache.put("x" * 600, list(range(50)))
    cache.put("x" * 600, list(range(100)))  # the same text again: replaced, counted once
    assert len(cache) == 1 and cache.num_bytes == _entry_bytes("x" * 600, 100)
    cache.put("y" * 600, list(range(101)))  # alone over the budget: not kept, nothing evicted for it
    assert cache.get("y" * 600) is None and len(cache) == 1
    assert len(PieceCache(budget_bytes=0)) == 0
    with pytest.raises(ValueError, match="budget_bytes"):
        PieceCache(budget_bytes=-1)


def test_a_growing_conversation_gives_the_tokenizers_ids_and_tokenizes_only_its_new_pieces(tiny):
    segments = tiny.prompt_segments
    assert segments is not None and segments.cache is not None
    tokenized: list[str] = []
    encode = segments._encode

    def counting(text: str) -> list[int]:
        tokenized.append(text)
        return encode(text)

    segments._encode = counting
    rng = random.Random(3)
    messages = [{"role": "system", "content": _long_text(rng, 3000)}]
    for turn in range(6):
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": _long_text(rng, 800)})
        tokenized.clear()
        ids = tiny.encode_chat(messages)
        assert ids == tiny.backend.encode(tiny.render_chat(messages), add_special_tokens=False).ids
        long_pieces = [piece for piece in tokenized if len(piece) >= MIN_CHARS]
        # The first turn tokenizes the system prompt and the message; later ones only the new message.
        assert len(long_pieces) == (2 if turn == 0 else 1), turn
        ids.clear()  # the caller owns what it got: the cache keeps its own copy
    assert tiny.encode_chat(messages) == tiny.backend.encode(tiny.render_chat(messages), add_special_tokens=False).ids
    assert all(len(piece) >= MIN_CHARS for piece in segments.cache._entries)  # short pieces are not kept


def test_pieces_evicted_under_a_small_budget_are_tokenized_again_the_same(tiny):
    backend = tiny.backend
    segments = PromptSegments.of(backend, [CHAT_TEMPLATE], PieceCache(budget_bytes=4 * _entry_bytes("x" * 700, 200)))
    assert segments is not None and segments.cache is not None
    rng = random.Random(4)
    texts = ["<|start_header_id|>user<|end_header_id|>\n\n" + _long_text(rng, rng.randrange(MIN_CHARS, 1500))
             + "<|eot_id|>" for _ in range(20)]
    for text in texts * 3 + rng.sample(texts, 20):
        assert segments.encode(text) == backend.encode(text, add_special_tokens=False).ids
        cache = segments.cache
        assert cache.num_bytes == sum(size for _, size in cache._entries.values()) <= cache.budget_bytes
    assert segments.cache.hits and segments.cache.misses > 20  # some came back after they were evicted


class _Counter:
    def __init__(self) -> None:
        self.children: dict[str, _Child] = {}

    def labels(self, result: str) -> _Child:
        return self.children.setdefault(result, _Child())


class _Child:
    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


def test_lookups_are_counted_into_the_metrics_once_at_each_flush():
    cache, counter, batch = PieceCache(), _Counter(), MetricBatch(flush_seconds=0.1)
    cache.get("x" * 600)  # before export: not counted
    count_lookups(cache, counter, batch)
    assert {name: child.value for name, child in counter.children.items()} == {"hit": 0.0, "miss": 0.0}
    cache.put("x" * 600, [1, 2])
    for _ in range(3):
        cache.get("x" * 600)
    cache.get("y" * 600)
    batch.flush()
    batch.flush()  # nothing new: nothing added twice
    assert (counter.children["hit"].value, counter.children["miss"].value) == (3.0, 1.0)
    count_lookups(None, _Counter(), batch)  # a tokenizer that keeps nothing: the series exist, at zero
