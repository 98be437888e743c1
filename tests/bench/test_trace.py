"""Trace replay's pieces without a server: loading a window, token ids per hash id, the ceiling."""

from __future__ import annotations

import json

import pytest

from disagg.bench.trace import TokenMap, TraceRequest, TraceWindow, load_trace, parse_window, prefix_ceiling


def write_trace(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def request(ts, hash_ids, length=None, out=4):
    return {"timestamp": ts, "input_length": length or 512 * len(hash_ids), "output_length": out, "hash_ids": hash_ids}


def test_window_selects_by_arrival_and_rebases_the_times(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [request(0, [0]), request(1500, [0, 1]), request(2500, [2]),
                                               request(4000, [3])])
    requests = load_trace(trace, parse_window("1:3"))
    assert [(r.timestamp, r.hash_ids) for r in requests] == [(500, [0, 1]), (1500, [2])]
    assert len(load_trace(trace)) == 4 and len(load_trace(trace, TraceWindow(), limit=3)) == 3
    assert len(load_trace(trace, parse_window("2:"))) == 2 and len(load_trace(trace, parse_window(":1"))) == 1


@pytest.mark.parametrize("text", ["5", "3:1", "a:b", "-1:2", "1:1"])
def test_bad_windows_name_the_option(text):
    with pytest.raises(ValueError, match="--window"):
        parse_window(text)


def test_bad_lines_name_the_file_and_line(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps(request(0, [0])) + "\n{\"timestamp\": 1}\n")
    with pytest.raises(ValueError, match=r"t.jsonl:2: not a trace request"):
        load_trace(trace)
    write_trace(trace, [request(0, [])])
    with pytest.raises(ValueError, match=r"t.jsonl:1: .*non-empty"):
        load_trace(trace)
    write_trace(trace, [request(10_000, [0])])
    with pytest.raises(ValueError, match="no request arrives in the window 0:5"):
        load_trace(trace, parse_window("0:5"))
    with pytest.raises(ValueError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


def test_equal_hash_ids_give_equal_tokens_and_lengths_scale():
    token_map = TokenMap(block_tokens=16, low=100, high=500, seed=7)
    blocks: dict[int, list[int]] = {}
    a = TraceRequest(0, 1000, 1, [5, 6])       # 1000 of 1024 tokens: the last block cut
    b = TraceRequest(0, 1536, 1, [5, 6, 9])
    ids_a, ids_b = token_map.prompt(a, blocks), token_map.prompt(b, blocks)
    assert len(ids_a) == 32 and len(ids_b) == 48  # ceil(1000 * 16 / 512), 1536 * 16 / 512
    assert ids_b[:32] == ids_a and all(100 <= t < 500 for t in ids_b)
    assert TokenMap(block_tokens=16, seed=7).block(9) == ids_b[32:]  # memoized or not, the same tokens
    assert TokenMap(block_tokens=16, seed=8).block(9) != ids_b[32:]
    assert token_map.block(5) != token_map.block(6)


def test_ceiling_counts_the_longest_prefix_sent_before():
    requests = [TraceRequest(0, 1024, 1, [0, 1]), TraceRequest(1, 1536, 1, [0, 1, 2]),
                TraceRequest(2, 1024, 1, [0, 3]), TraceRequest(3, 1024, 1, [4, 1])]  # 1 without its prefix 0: a miss
    ceiling = prefix_ceiling(requests, TokenMap())
    assert ceiling.blocks == pytest.approx((0 + 2 + 1 + 0) / 9)
    assert ceiling.tokens == pytest.approx((0 + 1024 + 512 + 0) / (1024 + 1536 + 1024 + 1024))
