"""A chat prompt tokenized piece by piece gives the tokenizer's own ids (api.prompt_segments)."""

from __future__ import annotations

import json
import random

import pytest
import tokenizers

from api.prompt_segments import PromptSegments
from api.tokenizer import Tokenizer
from workers.engine.model.tiny_tokenizer import CHAT_TEMPLATE

# Llama-3's and Qwen2's pre-tokenizer regex: a Split before a ByteLevel without its own regex.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_FRAGMENTS = (
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>",
    "<|", "|>", "<|eot", "_id|>", "<|start_header_id", "<tool>", "<tool>x", "user", "assistant", "system",
    "\n", "\n\n", " ", "  ", "\t", "\r\n", "Tell", " me", " a story.", "Hello world", "12345", "3.14",
    "'s", "'LL", "don't", "é", "e\u0301", "ﬁ", "中文", "😀", "👍🏽", "—", "{\"name\": \"x\"}", "  \n  ", ".",
)


def _variant(base: tokenizers.Tokenizer, *, normalizer=None, pre_tokenizer=None, add_tokens=()) -> tokenizers.Tokenizer:
    config = json.loads(base.to_str())
    if normalizer is not None:
        config["normalizer"] = normalizer
    if pre_tokenizer is not None:
        config["pre_tokenizer"] = pre_tokenizer
    backend = tokenizers.Tokenizer.from_str(json.dumps(config))
    backend.add_tokens(list(add_tokens))
    return backend


def _byte_level(**options) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True, **options}


def _variants(base: tokenizers.Tokenizer) -> dict[str, tokenizers.Tokenizer]:
    llama3 = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": _LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
        _byte_level(use_regex=False)]}
    # Added tokens whose text starts another's, in and out of the special set: leftmost-longest.
    overlapping = [tokenizers.AddedToken("<tool>", normalized=False), tokenizers.AddedToken("<tool>x", normalized=False),
                   tokenizers.AddedToken("<|eot", normalized=False, special=True)]
    return {
        "tiny": base,
        "llama3": _variant(base, pre_tokenizer=llama3),
        "qwen2": _variant(base, normalizer={"type": "NFC"}, pre_tokenizer=llama3),
        "prefix_space": _variant(base, pre_tokenizer=_byte_level(add_prefix_space=True)),
        "overlapping": _variant(base, add_tokens=overlapping),
        "digits_nfkc": _variant(base, normalizer={"type": "NFKC"}, pre_tokenizer={"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, _byte_level()]}),
    }


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(_FRAGMENTS) for _ in range(rng.randrange(0, 14)))


@pytest.mark.parametrize("name", ["tiny", "llama3", "qwen2", "prefix_space", "overlapping", "digits_nfkc"])
def test_pieces_give_the_tokenizers_ids_for_any_text(tiny, name):
    backend = _variants(tiny.backend)[name]
    segments = PromptSegments.of(backend, [CHAT_TEMPLATE])
    assert segments is not None
    assert segments._known  # the template's pieces are looked up, not tokenized: that path is tested too
    rng = random.Random(name)
    texts = [_random_text(rng) for _ in range(3000)] + ["", "user", "<|eot_id|>", "<|eot_id|><|eot_id|>", "\n\n"]
    for text in texts:
        assert segments.encode(text) == backend.encode(text, add_special_tokens=False).ids, repr(text)


@pytest.mark.parametrize("name", ["tiny", "llama3", "qwen2"])
def test_chat_prompts_give_the_ids_of_the_whole_rendered_text(tiny, name):
    backend = _variants(tiny.backend)[name]
    chat = Tokenizer(backend, {"chat_template": CHAT_TEMPLATE, "bos_token": "<|begin_of_text|>"})
    assert chat.prompt_segments is not None
    rng = random.Random(name)
    roles = ["system", "user", "assistant", "tool"]
    for _ in range(500):  # message text that holds special-token text and the template's own pieces
        messages = [{"role": rng.choice(roles), "content": _random_text(rng)} for _ in range(rng.randrange(1, 5))]
        text = chat.render_chat(messages)
        assert chat.encode_chat(messages) == backend.encode(text, add_special_tokens=False).ids, repr(text)


def test_known_pieces_are_the_templates_and_the_roles_not_a_requests(tiny):
    known = tiny.prompt_segments._known
    assert {"user", "assistant", "system", "\n\n"} <= known.keys()
    tiny.encode_chat([{"role": "user", "content": "a text never seen before"}])
    assert "\n\na text never seen before" not in known
    assert all(piece_ids == tiny.backend.encode(piece, add_special_tokens=False).ids
               for piece, piece_ids in known.items())


def _with_added_token(base: tokenizers.Tokenizer, **options) -> tokenizers.Tokenizer:
    backend = tokenizers.Tokenizer.from_str(base.to_str())
    backend.add_tokens([tokenizers.AddedToken("<tool>", **options)])
    return backend


def test_tokenizers_whose_pieces_do_not_tokenize_alone_are_encoded_whole(tiny):
    metaspace = _variant(tiny.backend, pre_tokenizer={"type": "Metaspace", "replacement": "▁",
                                                      "prepend_scheme": "first", "split": True})
    truncated = tokenizers.Tokenizer.from_str(tiny.backend.to_str())
    truncated.enable_truncation(8)
    raw_specials = tokenizers.Tokenizer.from_str(tiny.backend.to_str())
    raw_specials.encode_special_tokens = True
    refused = [metaspace, truncated, raw_specials, _variant(tiny.backend, normalizer={"type": "Lowercase"}),
               _with_added_token(tiny.backend, lstrip=True, normalized=False),
               _with_added_token(tiny.backend, normalized=True)]
    for backend in refused:
        assert PromptSegments.of(backend, [CHAT_TEMPLATE]) is None
        chat = Tokenizer(backend, {"chat_template": CHAT_TEMPLATE})
        messages = [{"role": "user", "content": "Tell me a story, <|eot_id|> ok"}]
        assert chat.encode_chat(messages) == backend.encode(chat.render_chat(messages), add_special_tokens=False).ids


def test_a_shipped_models_chat_prompts_give_the_ids_of_the_whole_rendered_text(smollm2_gguf):
    chat = Tokenizer.from_model_path(smollm2_gguf)  # ChatML: the role and the text share a piece
    assert chat.prompt_segments is not None
    fragments = ("<|im_start|>", "<|im_end|>", "<|im", "<|endoftext|>", "user", "assistant", "\n", " ", "Hello",
                 " world", "é", "中文", "😀", "12345")
    rng = random.Random(0)
    for _ in range(1000):
        messages = [{"role": rng.choice(["system", "user", "assistant"]),
                     "content": "".join(rng.choice(fragments) for _ in range(rng.randrange(1, 10)))}
                    for _ in range(rng.randrange(1, 4))]
        text = chat.render_chat(messages)
        assert chat.encode_chat(messages) == chat.backend.encode(text, add_special_tokens=False).ids, repr(text)
