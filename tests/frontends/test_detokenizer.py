"""Incremental detokenization and stop strings on the tiny model's byte-level BPE."""

from __future__ import annotations

import pytest

from api.detokenizer import IncrementalDetokenizer, StopStringMatcher
from api.tokenizer import Tokenizer

MULTIBYTE_TEXT = "Café 你好，世界！ 😀 🚀 done"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


def stream(tokenizer: Tokenizer, token_ids: list[int], prompt: list[int] = ()) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, list(prompt))
    pieces = [detokenizer.add([token_id]) for token_id in token_ids]
    return pieces + [detokenizer.flush()]


def test_multibyte_characters_split_across_tokens_never_emit_replacement_char(tokenizer):
    ids = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    # The test means something only if some character really is split over tokens.
    assert sum(tokenizer.token_text(i) == "\ufffd" for i in ids) >= 10
    pieces = stream(tokenizer, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == MULTIBYTE_TEXT
    assert pieces[-1] == ""  # nothing was left to flush: the text ends complete
    assert "" in pieces[:-1]  # some tokens were held back until their character completed


def test_prompt_context_does_not_leak_into_output(tokenizer):
    prompt = tokenizer.encode("The quick brown fox", add_special_tokens=True)
    ids = tokenizer.encode(" jumps over 你好", add_special_tokens=False)
    assert "".join(stream(tokenizer, ids, prompt)) == " jumps over 你好"


def test_special_tokens_are_skipped(tokenizer):
    eot = tokenizer.eos_token_id
    ids = tokenizer.encode("Hello world", add_special_tokens=False) + [eot]
    assert "".join(stream(tokenizer, ids)) == "Hello world"


def test_incomplete_character_is_held_back_then_flushed_at_end(tokenizer):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    emoji_ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(emoji_ids) > 1
    truncated = ids[:-1]  # the emoji's last byte never comes
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    emitted = "".join(detokenizer.add([i]) for i in truncated)
    assert emitted == "ok"
    tail = detokenizer.flush()
    assert tail.startswith(" ") and tail.endswith("\ufffd")
    assert emitted + tail == tokenizer.decode(truncated)


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], str | None]:
    out = []
    for piece in pieces:
        text, stop = matcher.feed(piece)
        out.append(text)
        if stop is not None:
            return out, stop
    out.append(matcher.flush())
    return out, None


def test_stop_string_across_token_boundaries_is_excluded(tokenizer):
    text = "Hello world! How are you today?"
    ids = tokenizer.encode(text, add_special_tokens=False)
    token_texts = [tokenizer.decode([i]) for i in ids]
    stop = "world! H"
    # The stop string spans at least three tokens.
    assert not any(stop in t for t in token_texts)
    out, matched = feed_all(StopStringMatcher((stop,)), stream(tokenizer, ids))
    assert matched == stop
    assert "".join(out) == "Hello "
    assert all("w" not in piece for piece in out)  # no prefix of the stop string ever reached the client


def test_earliest_stop_string_wins():
    out, matched = feed_all(StopStringMatcher(("today", "are")), ["How a", "re you to", "day"])
    assert (out, matched) == (["How ", ""], "are")


def test_possible_stop_prefix_is_held_then_released():
    matcher = StopStringMatcher(("you there",))
    assert matcher.feed("How are you") == ("How are ", None)
    assert matcher.feed(" t") == ("", None)  # "you t" could still become "you there"
    assert matcher.feed("oday") == ("you toda", None)  # a final "y" could begin "you there"
    assert matcher.flush() == "y"


def test_held_back_text_is_flushed_at_end():
    out, matched = feed_all(StopStringMatcher(("you there",)), ["How are ", "yo", "u"])
    assert matched is None
    assert out == ["How are ", "", "", "you"]


def test_empty_stop_strings_are_ignored():
    matcher = StopStringMatcher(("",))
    assert matcher.feed("abc") == ("abc", None)
