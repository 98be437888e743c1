"""The tokenizer and chat template rebuilt from SmolLM2's GGUF metadata equal transformers' for the
same file, token for token; and building them imports neither torch nor transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from api.tokenizer import Tokenizer

TEXTS = [
    "What is the capital of France?",
    "  two leading spaces, a trailing one ",
    "line one\nline two\r\n\n\tindented with a tab",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n",
    "日本語のテキストと絵文字 🤗🚀, Ünïcödé àccents, Ελληνικά, русский",
    "def f(x):\n    return x ** 2  # 1234567890 3.14159",
    "I'm sure they'll say we've done it; don't you think?",
    "",
    " ",
    "a" * 300,
    "https://example.com/path?query=1&b=2#frag",
    "<|endoftext|>after end of text",
    "Ġ and Ċ are byte-alphabet characters",
    "MiXeD CaSe, punctuation!!! ... ??? ---",
    "\u00a0non-breaking\u2009thin spaces\u200bzero width",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "A joke, please."}],
]


@pytest.fixture(scope="module")
def tokenizers_pair(smollm2_gguf):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    return Tokenizer.from_model_path(smollm2_gguf), reference


def test_encoding_equals_transformers(tokenizers_pair):
    ours, reference = tokenizers_pair
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids), text


def test_special_tokens_and_stop(tokenizers_pair):
    ours, _ = tokenizers_pair
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == 2  # the template's end of turn
    assert ours.bos_token == "<|im_start|>"
    assert ours.encode("<|im_end|>") == [2] and ours.vocab_size == 49152
    assert ours.model_max_length == 8192


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_chat_template_equals_apply_chat_template(tokenizers_pair, index):
    ours, reference = tokenizers_pair
    messages = CONVERSATIONS[index]
    for add_generation_prompt in (True, False):
        expected = reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False)
        assert ours.render_chat(messages, add_generation_prompt=add_generation_prompt) == expected
    assert ours.encode_chat(messages) == reference.apply_chat_template(messages, add_generation_prompt=True,
                                                                       tokenize=True, return_dict=False)
    if messages[0]["role"] != "system":  # SmolLM's template supplies its own system turn
        assert ours.render_chat(messages).startswith("<|im_start|>system\nYou are a helpful AI assistant")


def test_gguf_tokenizer_imports_no_torch(smollm2_gguf):
    code = (f"import sys\nfrom api.tokenizer import Tokenizer\n"
            f"t = Tokenizer.from_model_path({str(smollm2_gguf)!r})\nassert t.encode('hi')\n"
            "print(','.join(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
