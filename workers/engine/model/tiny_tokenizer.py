"""The tokenizer of the tiny test model: a byte-level BPE with Llama-3 special tokens.

Trained with the ``tokenizers`` library on a small built-in corpus (English,
Python, JSON and some non-ASCII text: é, 中文, emoji) so that merges and
multi-byte UTF-8 sequences are exercised by every test that decodes text.
Torch-free. Training is deterministic (tie-breaking in the BPE trainer is by
pair id, and ids come from a sorted alphabet); ``make_tiny_model`` tests pin
that by comparing the bytes of two generations.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Llama-3 names. Their ids are 0..N-1 (the trainer puts special tokens first).
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS = (
    BOS_TOKEN,
    EOS_TOKEN,
    "<|start_header_id|>",
    "<|end_header_id|>",
    EOT_TOKEN,
    "<|eom_id|>",
    "<|python_tag|>",
    "<|finetune_right_pad_id|>",
)

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A disaggregated serving system runs
prefill and decode on separate workers, so that long prompts do not stall the
tokens that other users are waiting for. Each worker keeps a paged cache of keys
and values; blocks are shared between requests that start with the same prefix.
When the cache is full, the scheduler preempts the newest request and recomputes
it later. Hello world! How are you today? I am fine, thank you. What is the
weather like in Paris? It is sunny, with a light breeze from the west.
Once upon a time, there was a little robot who wanted to learn how to paint.
Every morning it watched the sunrise and tried to mix the colours it saw.
"""

_CODE = '''\
def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Scheduler:
    def __init__(self, max_num_seqs: int = 64) -> None:
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        while self.waiting and budget > 0:
            request = self.waiting.pop(0)
            budget -= len(request.prompt_token_ids)
        return SchedulerOutput(requests=self.running)

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"role": "assistant", "content": "The temperature is 21 degrees."}
for (int i = 0; i < n; ++i) { sum += x[i] * y[i]; }
SELECT id, name FROM users WHERE age > 30 ORDER BY name;
'''

_NON_ASCII = """\
Café, naïve, résumé, déjà vu, crème brûlée, über, São Paulo, Zürich, Ångström.
你好，世界！我们今天去公园散步吧。中文分词是一个有趣的问题。
こんにちは、元気ですか。Привет, как дела? Γειά σου κόσμε. مرحبا بالعالم
Emoji: 😀 🚀 🎉 👍🏽 ❤️ 🇫🇷 — and math: ∑ ∫ √ π ≈ 3.14159, ∞ ≠ 0, α β γ.
"""


_SYLLABLES = (
    "ka lo mi ren tor sha vel qu ix bra dle ment ing tion er an el or us un re de pro "
    "con ver sal tek nor fi gu ha jo ze pa ri st on al is"
).split()


def tiny_corpus() -> list[str]:
    """The training text, one document per line, deterministic."""
    lines = (_ENGLISH + _CODE + _NON_ASCII).splitlines()
    numbers = [" ".join(str(i * j) for j in range(1, 12)) for i in range(1, 40)]
    return [line for line in lines if line.strip()] + numbers + _pseudo_words()


def _pseudo_words(num_lines: int = 120, words_per_line: int = 12) -> list[str]:
    # Made-up words from a fixed syllable list give the larger vocabulary
    # enough distinct pairs to merge; a 32-bit LCG keeps them identical on
    # every Python version.
    state = 12345
    lines = []
    for _ in range(num_lines):
        words = []
        for _ in range(words_per_line):
            state = (1103515245 * state + 12345) % 2**31
            num_syllables = 1 + state % 3
            word = ""
            for _ in range(num_syllables):
                state = (1103515245 * state + 12345) % 2**31
                word += _SYLLABLES[(state >> 8) % len(_SYLLABLES)]
            words.append(word)
        lines.append(" ".join(words))
    return lines


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE of exactly ``vocab_size`` tokens (special tokens included)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the corpus changes pair counts, not which pairs exist; a few
    # passes give frequent words a real lead over one-off pairs.
    tokenizer.train_from_iterator(tiny_corpus() * 3, trainer=trainer)
    _pad_to_vocab_size(tokenizer, vocab_size)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Llama-3: plain encode() prepends BOS; the chat template writes its own BOS
    # (so render with add_special_tokens=False, as HF does for chat).
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def _pad_to_vocab_size(tokenizer: Tokenizer, vocab_size: int) -> None:
    # The corpus may run out of merges before vocab_size; reserved special
    # tokens fill the rest, as in Llama-3, so config.vocab_size == tokenizer size.
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing < 0:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, more than {vocab_size}")
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(missing)]
    tokenizer.add_special_tokens(reserved)


# Llama-3.1 style: system (with tool definitions), user, assistant (text or
# tool calls as JSON), tool results under the "ipython" header.
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is none -%}
{%- else -%}{%- for part in content -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{{- bos_token }}
{%- if messages and messages[0]['role'] == 'system' %}
{%- set system_message = render_content(messages[0]['content']) %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set system_message = '' %}
{%- set loop_messages = messages %}
{%- endif %}
{%- if system_message or tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}
{{- 'You can call these tools. To call one, answer with JSON {\"name\": ..., \"parameters\": ...}.\\n' }}
{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{%- endfor %}
{{- '\\n' }}
{%- endif %}
{{- system_message }}{{ '<|eot_id|>' }}
{%- endif %}
{%- for message in loop_messages %}
{%- if message['role'] == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}{{ render_content(message['content']) }}{{ '<|eot_id|>' }}
{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- for call in message['tool_calls'] %}
{%- set function = call['function'] if call.get('function') else call %}
{{- '{\"name\": \"' }}{{ function['name'] }}{{ '\", \"parameters\": ' }}
{%- if function['arguments'] is string %}{{ function['arguments'] }}{% else %}{{ function['arguments'] | tojson }}{% endif %}
{{- '}' }}
{%- endfor %}
{{- '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' }}{{ message['role'] }}{{ '<|end_header_id|>\\n\\n' }}{{ render_content(message['content']) }}{{ '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


def write_tokenizer(model_dir: Path, vocab_size: int, max_model_len: int) -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json; return the special token ids."""
    tokenizer = build_tokenizer(vocab_size)
    (model_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    added = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in _special_tokens(tokenizer)
    }
    tokenizer_config = {
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "pad_token": EOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": max_model_len,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    text = json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n"
    (model_dir / "tokenizer_config.json").write_text(text, encoding="utf-8")
    return {
        "bos": _token_id(tokenizer, BOS_TOKEN),
        "eos": _token_id(tokenizer, EOS_TOKEN),
        "eot": _token_id(tokenizer, EOT_TOKEN),
    }


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:  # the trainer was given every special token: a bug if one is missing
        raise RuntimeError(f"the trained tokenizer lacks the special token {token!r}")
    return token_id


def _special_tokens(tokenizer: Tokenizer) -> list[str]:
    vocab_size = tokenizer.get_vocab_size()
    reserved = [tokenizer.id_to_token(i) for i in range(vocab_size)]
    return list(SPECIAL_TOKENS) + [t for t in reserved if t is not None and t.startswith("<|reserved_special_token_")]
