"""`disagg make-tiny-model --arch deepseek_v4`: every layer kind of the architecture, loadable by transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, DeepseekV4ForCausalLM


def test_config_has_every_layer_kind(tiny_dsv4_dir: Path) -> None:
    config = json.loads((tiny_dsv4_dir / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4"
    assert set(config["layer_types"]) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert set(config["mlp_layer_types"]) == {"hash_moe", "moe"}
    assert config["hc_mult"] == 4
    assert config["n_routed_experts"] >= 16 and config["num_experts_per_tok"] >= 4
    # 1,500 tokens give 375 CSA entries: the indexer really selects.
    assert config["index_topk"] * config["compress_rates"]["compressed_sparse_attention"] < 1500
    assert config["rope_parameters"]["compress"]["rope_type"] == "yarn"
    tokenizer = AutoTokenizer.from_pretrained(tiny_dsv4_dir)
    assert len(tokenizer) == config["vocab_size"]


def test_transformers_loads_every_weight(tiny_dsv4_dir: Path) -> None:
    model = DeepseekV4ForCausalLM.from_pretrained(tiny_dsv4_dir, dtype=torch.float32)
    # Written weights, not transformers' init: the zero-initialised ones are drawn.
    assert model.model.layers[1].self_attn.sinks.abs().min() > 0
    assert model.model.layers[1].self_attn.compressor.position_bias.abs().max() > 0.1
    tid2eid = model.model.layers[0].mlp.gate.tid2eid
    assert all(len(set(row.tolist())) == tid2eid.shape[1] for row in tid2eid[:32])
    with torch.no_grad():
        logits = model(torch.arange(200).unsqueeze(0)).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.5


def test_cli_writes_the_same_weights(tiny_dsv4_dir: Path, tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "disagg", "make-tiny-model", str(tmp_path / "m"), "--arch", "deepseek_v4"],
        check=True,
        capture_output=True,
    )
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == (tiny_dsv4_dir / "model.safetensors").read_bytes()
