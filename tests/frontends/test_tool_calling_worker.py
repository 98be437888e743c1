"""Agent loops through a real worker (launcher + torch engine + 2 frontends, the random-weight tiny
model) with the official SDKs: forced tool calls come back parsed and valid, their results go back
in the history, and the next turn runs.

The tiny model's template writes Llama-3 JSON calls; the grammar that forces them is built by
``frontends.tool_calls`` and enforced by the engine, so even random weights produce a call whose
arguments validate against the tool's schema.
"""

from __future__ import annotations

import pytest

from tool_loops import anthropic_client, anthropic_loop, openai_client, openai_loop
from worker_process import start_worker, stop_worker


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=2, engine="torch", extra_args=["--served-model-name", "tiny"])
    yield url
    assert stop_worker(proc) == 0


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_openai_required_loop(worker, stream):
    openai_loop(openai_client(worker), "tiny", "required", stream, parallel_tool_calls=False, temperature=0)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_openai_named_function_loop(worker, stream):
    choice = {"type": "function", "function": {"name": "get_time"}}
    openai_loop(openai_client(worker), "tiny", choice, stream, temperature=0)


def test_openai_required_sampled_with_parallel_calls(worker):
    client = openai_client(worker)
    for seed in range(3):
        openai_loop(client, "tiny", "required", False, temperature=1.0, seed=seed)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_anthropic_any_loop(worker, stream):
    anthropic_loop(anthropic_client(worker), {"type": "any", "disable_parallel_tool_use": True}, stream)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_anthropic_named_tool_loop(worker, stream):
    anthropic_loop(anthropic_client(worker), {"type": "tool", "name": "get_weather"}, stream)


def test_a_forced_call_wins_over_response_format(worker):
    # The answer is the call: response_format would constrain a text answer, and there is none.
    openai_loop(openai_client(worker), "tiny", "required", False, parallel_tool_calls=False, temperature=0,
                response_format={"type": "json_object"})
