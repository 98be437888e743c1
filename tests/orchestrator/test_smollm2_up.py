"""SmolLM2-135M-Instruct end to end: ``disagg up`` of configs/local.yaml (on free ports, every request
disaggregated), the official openai and anthropic clients, and the disaggregated answers against the
aggregated ones (the gen worker alone) token for token. One deployment for every assertion."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anthropic
import openai
import pytest
import yaml
from worker_process import free_port

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}
PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
    "Water boils at", "import numpy as np\n", "The largest planet in the solar system is", "A haiku about autumn:\n",
    "The opposite of hot is", "To make a cup of tea, first", "1, 2, 3, 4,", "The chemical symbol for gold is",
    "In 1492, Columbus", "SELECT * FROM users WHERE", "My favourite programming language is",
    "The speed of light is", "Paris is known for", "Dear Sir or Madam,\n", "The mitochondria is",
    "Photosynthesis converts",
]


def disagg(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disagg.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def deployment(smollm2_gguf, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smollm2-up")
    root = Path(__file__).resolve().parents[2]
    config = yaml.safe_load((root / "configs" / "local.yaml").read_text())
    assert config["model"] == MODEL  # the shipped default
    config["run_dir"] = str(tmp / "run")
    config["orchestrator"].update(port=free_port(), conditional={"enabled": False},
                                  health={"interval_seconds": 0.5})
    config["pools"]["ctx"].update(base_port=free_port(), frontends=1)
    config["pools"]["gen"].update(base_port=free_port(), frontends=1)
    path = tmp / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    up = disagg("up", str(path), cwd=tmp)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((tmp / "run" / "state.json").read_text())
        yield {**{process["name"]: process["url"] for process in state["processes"]},
               "worker_key": (tmp / "run" / "worker.key").read_text()}
    finally:
        disagg("down", "--run-dir", str(tmp / "run"), cwd=tmp)


def test_openai_and_anthropic_answer_paris(deployment):
    url = deployment["orchestrator"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, **GREEDY)
    assert "Paris" in chat.choices[0].message.content and chat.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, stream=True, **GREEDY)
    assert "Paris" in "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    message = claude.messages.create(model=MODEL, max_tokens=32, messages=QUESTION, extra_body=GREEDY)
    assert "Paris" in message.content[0].text and message.stop_reason == "end_turn"  # stopped on <|im_end|>
    with claude.messages.stream(model=MODEL, max_tokens=32, messages=QUESTION, extra_body=GREEDY) as events:
        assert "Paris" in events.get_final_text()


def test_disaggregated_equals_aggregated_token_for_token(deployment):
    disaggregated = openai.OpenAI(base_url=f"{deployment['orchestrator']}/v1", api_key="unused", max_retries=0)
    # A worker of the deployment answers only who presents its worker key (what the orchestrator sends).
    aggregated = openai.OpenAI(base_url=f"{deployment['gen-0']}/v1", api_key=deployment["worker_key"], max_retries=0)
    for prompt in PROMPTS:
        answers = []
        for client in (disaggregated, aggregated):
            raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=16, logprobs=0,
                                                              **GREEDY)
            completion = raw.parse()
            answers.append((completion.choices[0].logprobs.tokens, completion.choices[0].text))
            if client is disaggregated:
                assert raw.headers["x-disagg-mode"] == "disagg"  # a ctx leg, then a gen leg
        assert answers[0] == answers[1], prompt
        assert len(answers[0][0]) >= 1
