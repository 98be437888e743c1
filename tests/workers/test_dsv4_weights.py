"""DeepSeek-V4 config.json and checkpoint loading: key-named errors, published names, FP8/FP4 dequantization."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from workers.config import ConfigError
from workers.engine.model.deepseek_v4.config import AttentionKind, MlpKind, load_dsv4_config, parse_dsv4_config
from workers.engine.model.deepseek_v4.quant import FP4_E2M1_VALUES
from workers.engine.model.deepseek_v4.weights import load_dsv4_tensors


def _raw(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def test_config_reads_the_tiny_checkpoint(tiny_dsv4_dir: Path) -> None:
    config = load_dsv4_config(tiny_dsv4_dir)
    assert set(config.layer_kinds) == set(AttentionKind) and set(config.mlp_kinds) == set(MlpKind)
    assert (config.csa_rate, config.hca_rate, config.compress_rope.yarn_factor) == (4, 128, 16.0)
    assert config.main_rope.rope_dim == 8 and config.main_rope.yarn_factor is None


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"layer_types": ["sliding_attention", "full_attention", "x", "y", "z"]}, "config.json:layer_types"),
        ({"mlp_layer_types": ["moe"]}, "config.json:mlp_layer_types"),
        ({"scoring_func": "relu"}, "config.json:scoring_func"),
        ({"num_key_value_heads": 2}, "config.json:num_key_value_heads"),
        ({"o_groups": 3}, "config.json:o_groups"),
        ({"index_topk": "16"}, "config.json:index_topk"),
        ({"rope_parameters": {"rope_type": "yarn"}}, "config.json:rope_parameters.factor"),
    ],
)
def test_config_errors_name_the_key(tiny_dsv4_dir: Path, change: dict, key: str) -> None:
    raw = _raw(tiny_dsv4_dir) | change
    with pytest.raises(ConfigError) as error:
        parse_dsv4_config(raw)
    assert error.value.key == key


def test_legacy_keys_fold_like_transformers(tiny_dsv4_dir: Path) -> None:
    raw = {
        k: v for k, v in _raw(tiny_dsv4_dir).items() if k not in ("layer_types", "mlp_layer_types", "rope_parameters")
    }
    raw.pop("partial_rotary_factor")
    raw |= {"compress_ratios": [0, 4, 128, 4, 128, 0], "num_hash_layers": 2, "qk_rope_head_dim": 8}
    raw["rope_scaling"] = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 4096}
    config = parse_dsv4_config(raw)
    assert config.layer_kinds == load_dsv4_config(tiny_dsv4_dir).layer_kinds
    assert config.mlp_kinds == load_dsv4_config(tiny_dsv4_dir).mlp_kinds
    assert config.compress_rope == load_dsv4_config(tiny_dsv4_dir).compress_rope


def _fp8_block_quantize(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    grid = torch.zeros(-(-rows // block), -(-cols // block))
    for r in range(grid.shape[0]):
        for c in range(grid.shape[1]):
            tile = weight[r * block : (r + 1) * block, c * block : (c + 1) * block]
            grid[r, c] = tile.abs().max() / 448.0
    scale = grid.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return (weight / scale).to(torch.float8_e4m3fn), grid


def _fp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest e2m1 code per value, 1 x 32 blocks with power-of-two (UE8M0) scales, two codes per byte."""
    table = torch.tensor(FP4_E2M1_VALUES)
    blocks = weight.view(weight.shape[0], -1, 32)
    exponent = torch.ceil(torch.log2(blocks.abs().amax(-1) / 6.0)).clamp(min=-127)
    codes = (blocks / exponent.exp2().unsqueeze(-1)).unsqueeze(-1).sub(table).abs().argmin(-1).view(weight.shape[0], -1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, (exponent + 127).to(torch.uint8)


def _expected_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(FP4_E2M1_VALUES)
    as_bytes = packed.view(torch.uint8).long()
    values = torch.stack([table[as_bytes & 15], table[as_bytes >> 4]], -1).flatten(-2)
    return (values.view(values.shape[0], -1, 32) * (scale.float() - 127).exp2().unsqueeze(-1)).flatten(1)


def test_fp8_and_fp4_weights_are_dequantized(tiny_dsv4_dir: Path, tmp_path: Path) -> None:
    quantized_dir = tmp_path / "quantized"
    shutil.copytree(tiny_dsv4_dir, quantized_dir)
    tensors = load_file(tiny_dsv4_dir / "model.safetensors")
    expected: dict[str, torch.Tensor] = {}
    fp8_name, expert_name = "model.layers.2.attn.wq_b.weight", "model.layers.3.ffn.experts.5.w1.weight"
    weight, grid = _fp8_block_quantize(tensors[fp8_name], block=48)  # 128 x 32: a partial last block
    tensors[fp8_name], tensors[fp8_name.replace(".weight", ".scale")] = weight, grid
    expected["layers.2.self_attn.q_b_proj.weight"] = (
        weight.float() * grid.repeat_interleave(48, 0).repeat_interleave(48, 1)[:128, :32]
    )
    packed, scale = _fp4_quantize(tensors[expert_name])
    tensors[expert_name], tensors[expert_name.replace(".weight", ".scale")] = packed, scale
    expected["layers.3.mlp.experts.gate"] = _expected_fp4(packed, scale)
    save_file(tensors, quantized_dir / "model.safetensors", metadata={"format": "pt"})
    raw = _raw(quantized_dir) | {"quantization_config": {"quant_method": "fp8", "weight_block_size": [48, 48]}}
    (quantized_dir / "config.json").write_text(json.dumps(raw))
    loaded = load_dsv4_tensors(quantized_dir, load_dsv4_config(quantized_dir))
    assert torch.equal(loaded["layers.2.self_attn.q_b_proj.weight"], expected["layers.2.self_attn.q_b_proj.weight"])
    assert torch.equal(loaded["layers.3.mlp.experts.gate"][5], expected["layers.3.mlp.experts.gate"])
    # The round trip is close to the float weights: the right codes and scales were applied.
    original = load_file(tiny_dsv4_dir / "model.safetensors")
    assert (loaded["layers.2.self_attn.q_b_proj.weight"] - original[fp8_name]).abs().max() < 0.1
    assert (loaded["layers.3.mlp.experts.gate"][5] - original[expert_name]).abs().max() < 0.5


def test_mtp_layers_are_skipped_with_one_log_line(tiny_dsv4_dir: Path, tmp_path: Path, caplog) -> None:
    model_dir = tmp_path / "with-mtp"
    shutil.copytree(tiny_dsv4_dir, model_dir)
    tensors = load_file(tiny_dsv4_dir / "model.safetensors")
    tensors["mtp.0.attn.wq_a.weight"] = torch.zeros(2, 2)
    tensors["model.layers.5.attn.wq_a.weight"] = torch.zeros(2, 2)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("INFO"):
        loaded = load_dsv4_tensors(model_dir, load_dsv4_config(model_dir))
    assert not any(name.startswith(("mtp", "layers.5")) for name in loaded)
    assert [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()] == [
        "deepseek_v4: skipped 2 MTP tensors (speculative decoding heads, unused)"
    ]
