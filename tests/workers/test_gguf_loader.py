"""GGUF loading on a synthetic file: the tiny checkpoint written as llama.cpp lays it out loads into
exactly the safetensors model (names, q/k row order), and what the engine cannot run is refused
with an error that names it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_files import write_gguf

from workers.config import CacheConfig, ConfigError, EngineConfig
from workers.engine.model.gguf_metadata import gguf_model_config, open_gguf
from workers.engine.model.loader import load_model
from workers.engine.model.model_config import load_model_config
from workers.engine.model.tiny import make_tiny_model
from workers.engine.model_runner import ModelRunner

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gguf")
    model_dir = make_tiny_model(root / "tiny", size="test")
    return model_dir, write_gguf(model_dir, root / "tiny.gguf")


def test_config_from_metadata_equals_config_json(tiny):
    model_dir, gguf_path = tiny
    ours = gguf_model_config(open_gguf(gguf_path))
    expected = load_model_config(model_dir)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "rope_theta", "max_position_embeddings", "tie_word_embeddings", "qkv_bias"):
        assert getattr(ours, field) == getattr(expected, field), field
    assert ours.rms_norm_eps == pytest.approx(expected.rms_norm_eps)
    assert ours.eos_token_ids <= expected.eos_token_ids and ours.eos_token_ids


def test_float32_file_loads_the_same_parameters(tiny):
    model_dir, gguf_path = tiny
    expected, _ = load_model(model_dir, "float32", CPU)
    ours, _ = load_model(gguf_path, "float32", CPU)
    expected_state, our_state = expected.state_dict(), ours.state_dict()
    assert our_state.keys() == expected_state.keys()
    for name, tensor in expected_state.items():
        assert torch.equal(our_state[name], tensor), name  # q/k rows unpermuted exactly


def test_quantized_file_gives_close_logits(tiny, tmp_path):
    model_dir, _ = tiny
    # Q8_0 everywhere but the norms (ggml keeps 1-D tensors in F32): logits stay close to float32's.
    types = {name: "Q8_0" for name in ("token_embd.weight", "output.weight")}
    types.update({f"blk.{i}.{t}.weight": "Q8_0" for i in range(2)
                  for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")})
    gguf_path = write_gguf(model_dir, tmp_path / "q8.gguf", types=types)
    cache = CacheConfig(block_size=4, num_blocks=16)
    prompt = [5, 47, 268, 290, 228, 42, 72, 77, 418, 228]
    logits = {}
    from test_model_reference import _paged_logits

    for name, path in (("hf", model_dir), ("q8", gguf_path)):
        runner = ModelRunner(EngineConfig(model=str(path), device="cpu", cache=cache))
        logits[name] = _paged_logits(runner, prompt, [0, 1, 2], 6)
    scale = logits["hf"].abs().max()
    assert (logits["q8"] - logits["hf"]).abs().max() / scale < 0.05
    assert torch.equal(logits["q8"].argmax(-1), logits["hf"].argmax(-1))


def test_unsupported_architecture_is_named(tiny, tmp_path):
    model_dir, _ = tiny
    path = write_gguf(model_dir, tmp_path / "other.gguf", architecture="gpt2")
    with pytest.raises(ConfigError) as info:
        load_model(path, "float32", CPU)
    assert info.value.key.endswith("general.architecture") and "'gpt2'" in str(info.value)


def test_synthetic_engine_takes_vocabulary_and_context_from_the_file(tiny):
    import argparse

    from disagg.serve import add_serve_arguments, build_engine_config

    _, gguf_path = tiny
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = build_engine_config(parser.parse_args([str(gguf_path), "--engine", "synthetic"]))
    assert (config.synthetic.vocab_size, config.synthetic.max_model_len) == (512, 2048)
