"""Agent loops through the orchestrator in disaggregated mode (a ctx and a gen worker, torch engine):
the ctx leg samples the first token of a forced call under the grammar, the gen leg continues it, and
the client gets parsed, schema-valid calls, streamed and not, on both APIs."""

from __future__ import annotations

import anthropic
import openai
import pytest
from orchestrator_process import start_orchestrator, stop_orchestrator
from tool_cuts import check_cut_calls
from tool_loops import anthropic_client, anthropic_loop, openai_client, openai_loop
from worker_process import disagg_worker_args, start_worker, stop_worker


@pytest.fixture(scope="module")
def disagg_url(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools-disagg")
    common = disagg_worker_args(tmp) + ["--served-model-name", "tiny"]
    ctx = start_worker(tiny_model_dir, 1, engine="torch", extra_args=["--role", "ctx", *common])
    gen = start_worker(tiny_model_dir, 1, engine="torch", extra_args=["--role", "gen", *common])
    url, proc = start_orchestrator(tmp, tiny_model_dir, [("ctx", ctx[0]), ("gen", gen[0])], processes=1,
                                   conditional={"enabled": False}, served_model_name="tiny")
    yield url
    assert stop_orchestrator(proc) == 0
    for _, worker in (ctx, gen):
        stop_worker(worker)


def test_openai_streamed_loop_disaggregated(disagg_url):
    client = openai_client(disagg_url)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert raw.headers["x-disagg-mode"] == "disagg"
    openai_loop(client, "tiny", {"type": "function", "function": {"name": "get_weather"}}, True, temperature=0)
    openai_loop(client, "tiny", "required", True, parallel_tool_calls=False, temperature=0)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_anthropic_loop_disaggregated(disagg_url, stream):
    anthropic_loop(anthropic_client(disagg_url), {"type": "tool", "name": "get_time"}, stream)


def test_tool_errors_reach_the_client_through_the_orchestrator(disagg_url):
    client = openai_client(disagg_url)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       tools=[{"type": "function", "function": {"name": "f"}}],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice.function.name"
    with pytest.raises(anthropic.BadRequestError, match="not in tools"):
        anthropic_client(disagg_url).messages.create(
            model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
            tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice={"type": "tool", "name": "nope"})


def test_cut_forced_calls_have_one_shape_disaggregated(disagg_url):
    """The gen worker parses what both legs generated: a call that max_tokens cuts reaches the client
    with the same shape, streamed or not, on chat, messages and Responses (the orchestrator's own)."""
    check_cut_calls(openai_client(disagg_url), anthropic_client(disagg_url))
