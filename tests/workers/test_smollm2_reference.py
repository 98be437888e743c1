"""SmolLM2-135M-Instruct from its Q4_1 GGUF: the engine against transformers loading the same file.

Logits of a prefill and 30 paged decode steps across block boundaries (float32: within 1e-3 of the
logit scale; bfloat16: its own tolerance), and greedy 32-token continuations identical to
transformers' ``generate`` for 10 prompts, chat and plain, run as one continuous batch.
"""

from __future__ import annotations

import pytest
import torch
from engine_runs import run, tokens
from test_model_reference import _paged_logits

from workers.config import CacheConfig, EngineConfig
from workers.engine.core import EngineCore
from workers.engine.model_runner import ModelRunner
from workers.protocol import EngineRequest
from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

FLOAT32_TOLERANCE = 1e-3  # max |ours - transformers| / max |transformers logit|
BFLOAT16_TOLERANCE = 0.1  # bfloat16 weights and activations (8 mantissa bits) through 30 layers
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Name three fruits."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "What is 12 times 11?"}],
]
PLAIN = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a small village,",
         "The three primary colors are", "import numpy as np\n"]


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


def _prompts(tokenizer) -> list[list[int]]:
    chats = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in CHATS]
    return [tokenizer.encode(text, add_special_tokens=False) for text in chats + PLAIN]


def _runner(path, dtype: str) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(path), device="cpu", dtype=dtype,
                                    cache=CacheConfig(block_size=16, num_blocks=8)))


def _reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]  # (T, vocab)


@pytest.fixture(scope="module")
def sequence_and_logits(reference) -> tuple[list[int], torch.Tensor]:
    """A 10-token chat prompt and 30 tokens of the model's own greedy continuation; transformers'
    logits at the positions the engine samples: the ends of two prefill chunks, then 30 decodes."""
    model, tokenizer = reference
    text = tokenizer.apply_chat_template(CHATS[1], add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)[:10]
    with torch.no_grad():
        sequence = model.generate(torch.tensor([prompt]), max_new_tokens=30, min_new_tokens=30,
                                  do_sample=False)[0].tolist()[:40]
    logits = _reference_logits(model, sequence)
    return sequence, torch.cat([logits[4:5], logits[9:10], logits[10:]])


@pytest.mark.parametrize("dtype, tolerance", [("float32", FLOAT32_TOLERANCE), ("bfloat16", BFLOAT16_TOLERANCE)])
def test_paged_logits_match_transformers(smollm2_gguf, sequence_and_logits, dtype, tolerance):
    sequence, expected = sequence_and_logits
    ours = _paged_logits(_runner(smollm2_gguf, dtype), sequence, [6, 1, 4], prefill=10)  # blocks of 16: 2 crossings
    assert ours.shape == expected.shape == (32, 49152)
    relative = ((ours - expected).abs().max() / expected.abs().max()).item()
    print(f"SmolLM2 {dtype}: max |engine - transformers| / logit scale = {relative:.2e}")
    assert relative <= tolerance


def test_greedy_continuations_equal_transformers_generate(smollm2_gguf, reference):
    model, tokenizer = reference
    prompts = _prompts(tokenizer)
    config = EngineConfig(model=str(smollm2_gguf), device="cpu", cache=CacheConfig(block_size=16, num_blocks=64))
    params = SamplingParams(temperature=0.0, max_tokens=32)  # both stop at <|im_end|>, the file's EOS
    outputs = run(EngineCore(config), *(EngineRequest(request_id=i, prompt_token_ids=p, sampling_params=params)
                                        for i, p in enumerate(prompts)))
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):]
        expected = expected.tolist()
        assert tokens(outputs[i]) == expected, (i, tokenizer.decode(tokens(outputs[i])), tokenizer.decode(expected))
    assert "Paris" in tokenizer.decode(tokens(outputs[0]))


def test_guided_json_from_the_gguf_tokenizer(smollm2_gguf):
    """The engine's grammar compiler takes its tokenizer from the GGUF metadata (no tokenizer.json)."""
    import json

    from api.tokenizer import Tokenizer
    from workers.sampling_params import GuidedDecoding

    tokenizer = Tokenizer.from_model_path(smollm2_gguf)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    params = SamplingParams(temperature=0.0, max_tokens=24, guided=GuidedDecoding("json_schema", json.dumps(schema)))
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France? Answer in JSON."}])
    cache = CacheConfig(block_size=16, num_blocks=16)
    core = EngineCore(EngineConfig(model=str(smollm2_gguf), device="cpu", cache=cache))
    outputs = run(core, EngineRequest(request_id=1, prompt_token_ids=prompt, sampling_params=params))
    assert json.loads(tokenizer.decode(tokens(outputs[1]))) == {"city": "Paris"}
