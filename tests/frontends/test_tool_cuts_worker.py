"""Forced tool calls cut by ``max_tokens`` through a real worker (launcher + torch engine, the
random-weight tiny model), in both call formats: on chat, messages and Responses, streamed and not,
the SDKs assemble the same answer, and it holds calls, the last one cut, never the format's markup
as text (``tests/tool_cuts.py``)."""

from __future__ import annotations

import pytest
from tool_cuts import check_cut_calls
from tool_loops import anthropic_client, openai_client
from worker_process import start_worker, stop_worker

pytestmark = pytest.mark.slow  # a worker per call format


@pytest.fixture(scope="module", params=["llama3_json", "hermes"])
def worker(tiny_model_dir, request):
    # The tiny model's template writes Llama-3 JSON calls; --tool-call-parser hermes makes the
    # grammar force (and the parser read) Hermes calls instead.
    url, proc = start_worker(tiny_model_dir, num_frontends=1, engine="torch",
                             extra_args=["--served-model-name", "tiny", "--tool-call-parser", request.param])
    yield url
    assert stop_worker(proc) == 0


def test_cut_forced_calls_have_one_shape_streamed_or_not(worker):
    check_cut_calls(openai_client(worker), anthropic_client(worker))
