"""``disagg bench URL --trace FILE`` against a real worker (synthetic engine): arrivals, token-id prompts,
cached tokens against the window's ceiling, the JSON and the plots."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.bench.test_trace import request, write_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def conversations():
    """Three conversations of four turns under one shared system block (hash id 0), interleaved as a chat
    service's are: turn t of each resends its earlier blocks and adds one. Arrivals 150 ms apart, so each
    prompt's prefill is done before the next prompt that shares it arrives."""
    lines, next_id, history = [], 1, {c: [0] for c in range(3)}
    for turn in range(4):
        for c in range(3):
            history[c] = [*history[c], next_id]
            next_id += 1
            lines.append(request(150 * len(lines), list(history[c]), out=3 + turn))
    return lines


def bench(*argv: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disagg.cli", "bench", *argv], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_a_replay_meets_the_ceiling_of_its_window(worker, tmp_path):
    trace = write_trace(tmp_path / "conv.jsonl", conversations())
    done = bench(worker, "--trace", str(trace), "--block-tokens", "16", "--window", "0.3:", "--slo", "ttft=5s",
                 "--out", str(tmp_path), "--name", "replay", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "replay.json").read_text())
    (run,) = result["runs"]
    assert run["mode"] == "trace" and run["level"] == 1 and run["num_ok"] == run["num_requests"] == 10
    records = run["records"]
    # the first two requests (0.0 s, 0.15 s) are outside the window; each prompt is 16 tokens a block
    expected = conversations()[2:]
    assert [r["prompt_tokens"] for r in records] == [16 * len(line["hash_ids"]) for line in expected]
    assert [r["output_tokens"] for r in records] == [line["output_length"] for line in expected]  # ignore_eos
    starts = [r["start"] for r in records]  # sent at the trace's times, rebased to the window's start
    assert starts[0] < 0.1 and all(0.1 < later - earlier < 0.3 for earlier, later in zip(starts, starts[1:]))
    assert starts[-1] - starts[0] == pytest.approx(1.35, abs=0.1)
    trace_part = result["trace"]
    assert trace_part["requests"] == 10 and trace_part["window"] == "0.3:"
    # Prefixes sent before inside the window, in blocks: [0,3] 0; [0,1,4] 1 (conversation 0's first turn
    # is outside the window) and [0,2,5] 1; [0,3,6] 2; then 3, 3, 3 and 4, 4, 4: 25 of 38 blocks.
    assert trace_part["ceiling_tokens"] == pytest.approx(25 / 38) == trace_part["ceiling_blocks"]
    # one worker that keeps every block meets the ceiling exactly
    assert run["cached_fraction"] == pytest.approx(trace_part["ceiling_tokens"])
    assert trace_part["cached_of_ceiling"] == pytest.approx(1.0)
    assert "of the ceiling" in done.stdout and run["goodput_requests_per_s"] > 0
    assert (tmp_path / "replay-latency-cdf.png").read_bytes().startswith(PNG_MAGIC)


def test_trace_arguments_are_checked_before_any_request(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [request(0, [0])])
    for argv, message in ((["--concurrency", "2"], "drop --concurrency"), (["--api", "anthropic"], "--api anthropic"),
                          (["--time-scale", "0"], "--time-scale"), (["--token-ids", "5:5"], "--token-ids"),
                          (["--window", "9:10"], "no request arrives")):
        done = bench("http://127.0.0.1:9", "--trace", str(trace), *argv, cwd=tmp_path)
        assert done.returncode == 2 and message in done.stderr, (argv, done.stderr)
