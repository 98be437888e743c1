"""``disagg bench`` refuses bad arguments with one clear line (exit 2), and its parts compute what they say."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from disagg.bench.api_clients import AnthropicMessages, OpenAIChat, OpenAIResponses
from disagg.bench.lengths import LengthDist, parse_length
from disagg.bench.metrics import Distribution, parse_slo
from tests.worker_process import free_port


def bench(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disagg.cli", "bench", *argv], capture_output=True, text=True,
                          timeout=60, cwd=cwd)


@pytest.mark.parametrize("argv, message", [
    (["localhost:8000"], "URL: expected http://HOST:PORT"),
    (["http://127.0.0.1:1", "--concurrency", "0"], "--concurrency: every value must be > 0"),
    (["http://127.0.0.1:1", "--rate", "fast"], "--rate: expected comma-separated numbers"),
    (["http://127.0.0.1:1", "--slo", "latency=1s"], "--slo: expected KEY=DURATION"),
    (["http://127.0.0.1:1", "--slo", "ttft=soon"], "--slo: ttft: expected a duration"),
    (["http://127.0.0.1:1", "--isl", "lots"], "--isl: expected MEAN or MEAN:STDDEV"),
    (["http://127.0.0.1:1", "--tool-turn-fraction", "2"], "--tool-turn-fraction: must be in [0, 1]"),
    (["http://127.0.0.1:1", "--num-requests", "0"], "--num-requests: must be > 0"),
    (["compare", "only-one.json"], "expected two results files"),
])
def test_bad_arguments_exit_2_with_one_line(argv, message):
    done = bench(*argv)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr


def test_bad_api_choice_is_argparse_usage():
    done = bench("http://127.0.0.1:1", "--api", "grpc")
    assert done.returncode == 2 and "invalid choice: 'grpc'" in done.stderr


def test_unreachable_server_exits_1(tmp_path):
    done = bench(f"http://127.0.0.1:{free_port()}", "--num-requests", "1", cwd=tmp_path)
    assert done.returncode == 1 and "is it up?" in done.stderr and "Traceback" not in done.stderr
    assert not list(tmp_path.iterdir())  # no results file for a run that never ran


def test_compare_refuses_a_file_that_is_not_results(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"hello": 1}))
    done = bench("compare", str(tmp_path / "a.json"), str(tmp_path / "a.json"))
    assert done.returncode == 2 and "not a disagg bench results file" in done.stderr


def test_without_the_bench_extra_it_says_how_to_install():
    code = ("import sys; sys.modules['matplotlib'] = None; from disagg.cli import main; "
            "raise SystemExit(main(['bench', 'http://127.0.0.1:1']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == "disagg bench: needs matplotlib and rich: pip install 'disagg[bench]' (or `make setup`)"


def test_no_torch_in_the_client():
    code = "import sys, disagg.bench.cli, disagg.bench.runner, disagg.bench.report; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_slo_and_lengths_parse():
    assert parse_slo("ttft=2s,itl=50ms,e2e=10") == {"ttft": 2.0, "itl": 0.05, "e2e": 10.0}
    assert parse_length("200:50", "--isl") == LengthDist(200, 50)
    assert parse_length("24", "--osl") == LengthDist(24, 0)


def test_percentiles_interpolate_like_numpy():
    d = Distribution.of([4.0, 1.0, 3.0, 2.0, None])
    assert (d.count, d.p50, d.p90, d.min, d.max) == (4, 2.5, 3.7, 1.0, 4.0)
    assert Distribution.of([]).p50 is None


def test_stream_parsers_read_text_usage_and_errors():
    chunk = '{"choices":[{"delta":{"content":"hi"}}]}'
    assert OpenAIChat("m").parse("", chunk).text == "hi"
    usage = OpenAIChat("m").parse("", '{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3,'
                                      '"prompt_tokens_details":{"cached_tokens":8}}}').usage
    assert (usage.prompt_tokens, usage.output_tokens, usage.cached_tokens) == (9, 3, 8)
    assert OpenAIChat("m").parse("", "[DONE]").done
    assert "overloaded" in OpenAIChat("m").parse("", '{"error":{"type":"overloaded","message":"x"}}').error
    start = AnthropicMessages("m").parse("message_start", '{"type":"message_start","message":{"usage":'
                                                          '{"input_tokens":2,"cache_read_input_tokens":5}}}')
    assert (start.usage.prompt_tokens, start.usage.cached_tokens) == (7, 5)
    assert OpenAIResponses("m").parse("", '{"type":"response.output_text.delta","delta":"yo"}').text == "yo"


def test_each_stream_sends_its_own_prompts():
    """Sweep levels (and the warm-up) draw separate streams: a level must not find the previous
    level's prompts in the server's prefix cache."""
    from disagg.bench.text import TextSource
    from disagg.bench.workload import Workload, WorkloadConfig

    def first_prompts(stream: int) -> list[str]:
        workload = Workload(WorkloadConfig(turns=LengthDist(1)), TextSource(), stream)
        prompts = []
        for _ in range(3):
            session, conversation = workload.next_session(), workload.start()
            workload.add_turn(conversation, session, 0, workload.session_rng(session))
            prompts.append(conversation.messages[-1].text)
        return prompts

    assert first_prompts(1) == first_prompts(1)  # deterministic
    assert not set(first_prompts(1)) & set(first_prompts(2))
    assert Workload(WorkloadConfig(), TextSource(), 1).system == Workload(WorkloadConfig(), TextSource(), 2).system
