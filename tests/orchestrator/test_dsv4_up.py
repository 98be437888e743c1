"""configs/dsv4.yaml serves the DeepSeek-V4 architecture: `disagg up` of the file as written, its pools
cut to 1 ctx + 1 gen worker and run on this machine (`launcher: local`), answers a completion
with the DeepSeek-V4 engine's own greedy tokens through both legs, then `disagg down`."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from test_up import disagg
from transformers import AutoTokenizer
from worker_process import free_port

from tests.workers.dsv4_reference import greedy_tokens
from workers.engine.model.deepseek_v4.model import DeepseekV4Model

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_dsv4_yaml_comes_up_on_the_deepseek_v4_engine_and_answers(tmp_path: Path) -> None:
    data = yaml.safe_load((REPO / "configs" / "dsv4.yaml").read_text())
    assert (data["model"], data["tiny_model_arch"], data["engine"]["kind"]) == ("tiny", "deepseek_v4", "torch")
    port = free_port()
    data.update(launcher="local", run_dir=str(tmp_path / "run"))
    data["orchestrator"].update(port=port, processes=1)
    data["pools"] = {role: {**data["pools"][role], "instances": 1, "frontends": 1, "base_port": free_port()}
                     for role in ("ctx", "gen")}
    config = tmp_path / "dsv4.yaml"
    config.write_text(yaml.safe_dump(data))
    up = disagg("up", str(config), cwd=tmp_path, timeout=1800)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        model_dir = tmp_path / "run" / "model"
        assert json.loads((model_dir / "config.json").read_text())["model_type"] == "deepseek_v4"
        ids = torch.randint(0, 512, (140,), generator=torch.Generator().manual_seed(7)).tolist()
        body = {"model": "tiny", "prompt": ids, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600)
        assert response.status_code == 200, response.text
        assert response.headers["x-disagg-mode"] == "disagg"
        out = greedy_tokens(DeepseekV4Model.from_dir(model_dir), ids, 3)
        assert response.json()["choices"][0]["text"] == AutoTokenizer.from_pretrained(model_dir).decode(out)
    finally:
        down = disagg("down", cwd=tmp_path, timeout=300)
        assert down.returncode == 0, down.stdout + down.stderr
