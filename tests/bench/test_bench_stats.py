"""``bench compare``'s statistics on known inputs: intervals, windows, workload differences, verdicts."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from disagg.bench import stats
from disagg.bench.compare import compare_lines, workload_differences
from disagg.bench.metrics import RequestRecord, summarize


def test_weighted_median_is_the_lower_median_of_the_repeated_values():
    values = np.array([1.0, 2.0, 3.0, 4.0])
    assert stats.weighted_median(values, np.ones(4)) == 2.0  # lower median of 1,2,3,4
    assert stats.weighted_median(values, np.array([0, 0, 1, 5])) == 4.0  # 3,4,4,4,4,4
    assert stats.weighted_median(values, np.array([3, 0, 0, 1])) == 1.0  # 1,1,1,4


def test_t_quantiles_round_the_degrees_of_freedom_down():
    assert stats.t_quantile(1) == 12.706 and stats.t_quantile(4.9) == 2.776
    assert stats.t_quantile(30) == 2.042 and stats.t_quantile(80) == 2.042 and stats.t_quantile(500) == 1.98


def test_welch_interval_by_hand():
    # means 2 and 5, variances 1 each: se = sqrt(2/3), Welch df = 4, t = 2.776
    interval = stats.welch_difference([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    half = 2.776 * (2 / 3) ** 0.5
    assert interval.difference == 3.0
    assert interval.low == pytest.approx(3.0 - half) and interval.high == pytest.approx(3.0 + half)
    assert not interval.within_noise
    assert stats.welch_difference([1.0, 2.0, 3.0], [1.5, 2.5, 2.0]).within_noise
    assert stats.welch_difference([1.0, 2.0], [1.0, 2.0, 3.0]) is None  # too few windows
    assert stats.welch_difference([2.0] * 3, [2.0] * 3) == stats.Interval(0.0, 0.0, 0.0)


def test_window_rates_sum_to_the_level_throughput():
    completions = [(t * 0.1, 8.0) for t in range(1, 31)]  # 30 requests of 8 tokens over 3 s
    rates = stats.window_rates(completions, duration=3.0)
    assert len(rates) == 6  # 30 // 5
    assert sum(rates) / len(rates) == pytest.approx(30 * 8 / 3.0)
    assert stats.window_rates(completions[:14], duration=3.0) == []  # 2 windows: no interval


def test_bootstrap_tells_a_shift_from_noise():
    rng = random.Random(1)
    a = [[rng.gauss(100, 10)] for _ in range(200)]
    same = [[rng.gauss(100, 10)] for _ in range(200)]
    shifted = [[rng.gauss(110, 10)] for _ in range(200)]
    noise = stats.median_difference(a, same)
    assert noise.within_noise and noise.low < 0 < noise.high and noise.high - noise.low < 8
    signal = stats.median_difference(a, shifted)
    assert not signal.within_noise and 5 < signal.low < signal.difference < signal.high < 15
    assert stats.median_difference(a, same) == noise  # a fixed seed: the same files print the same interval
    assert stats.median_difference(a[:4], same) is None


def test_cluster_bootstrap_resamples_whole_requests():
    """Requests whose gaps are all alike: resampling gaps alone would see 1,000 values and a
    narrow interval; resampling requests sees 10 and a wide one."""
    rng = random.Random(2)
    a = [[float(rng.randint(1, 9))] * 100 for _ in range(10)]
    b = [[float(rng.randint(1, 9))] * 100 for _ in range(10)]
    by_request = stats.median_difference(a, b)
    by_gap = stats.median_difference([[v] for g in a for v in g], [[v] for g in b for v in g])
    assert by_request.high - by_request.low > 2 * (by_gap.high - by_gap.low)


def make_result(ttft: float, seed: int, **workload_changes) -> dict:
    """A results file of one closed-loop level: 60 requests whose TTFT is about ``ttft`` seconds."""
    rng = random.Random(seed)
    records = []
    for i in range(60):
        first = rng.gauss(ttft, ttft / 10)
        itls = [rng.gauss(0.01, 0.001) for _ in range(7)]
        records.append(RequestRecord(i, 0, i * 0.1, ttft=first, e2e=first + sum(itls), itls=itls, prompt_tokens=50,
                                     output_tokens=8))
    workload = {"system_tokens": 0, "isl": "20", "osl": "8", "turns": "1", "single_turn_fraction": 0.0,
                "tool_turn_fraction": 0.0, "tool_result_tokens": 100, "seed": seed, **workload_changes}
    summary = summarize(records, "concurrency", 2.0, 6.5, {})
    return {"format": "disagg-bench/1", "url": "http://127.0.0.1:1", "api": "openai", "model": "m",
            "ignore_eos": False, "workload": workload, "tokens_per_word": 1.3, "tokenizer": "deployment", "slo": {},
            "server": {"version": {"version": "0.1.0"}},
            "runs": [{**summary.to_dict(), "records": [dataclasses.asdict(r) for r in records]}]}


def test_workload_differences_name_each_option_and_ignore_the_seed():
    a = make_result(0.1, seed=1)
    assert workload_differences(a, make_result(0.1, seed=2)) == []
    b = make_result(0.1, seed=1, isl="200", turns="4")
    b.update(api="anthropic", model="other", slo={"ttft": 2.0}, tokens_per_word=1.6, tokenizer="estimate")
    b["runs"][0]["level"] = 4.0
    assert workload_differences(a, b) == [
        "--api: 'openai' vs 'anthropic'", "model: 'm' vs 'other'",
        "levels: concurrency 2 vs concurrency 4",
        "--isl: 20 vs 200", "--turns: 1 vs 4",
        "--slo: none vs ttft=2000ms (goodput is not comparable)",
        "prompt text: 1.300 vs 1.600 tokens per word (tokenizer deployment vs estimate): "
        "the same token counts are different prompts"]


def _line(lines: list[str], figure: str) -> str:
    return next(line for line in lines if line.strip().startswith(figure))


def test_compare_says_within_noise_for_the_same_server_and_names_a_real_shift():
    a = make_result(0.100, seed=1)
    lines = compare_lines(a, make_result(0.100, seed=2), ("a", "b"))
    assert "server 0.1.0" in lines[0] and lines[2].startswith("95% intervals of B - A")
    assert _line(lines, "TTFT p50").endswith("within noise")
    assert _line(lines, "out tok/s").endswith("within noise")
    slower = compare_lines(a, make_result(0.150, seed=2), ("a", "b"))
    assert _line(slower, "TTFT p50").endswith("B higher (worse)")
    assert _line(slower, "ITL p50").endswith("within noise")  # the same gaps in both


def test_plots_tick_the_levels_legend_every_line_and_draw_the_slo(monkeypatch, tmp_path):
    from disagg.bench import plots

    result = make_result(0.1, seed=1)
    result["runs"] = [{**result["runs"][0], "level": level} for level in (1.0, 4.0, 16.0)]
    result["slo"] = {"ttft": 0.12, "itl": 0.02}
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    plots.plot_sweep(result, tmp_path / "sweep.png")
    plots.plot_turns(result, tmp_path / "turns.png")
    plots.plot_latency_cdfs(result, tmp_path / "cdf.png")
    sweep, turns, cdfs = figures
    for ax in sweep.axes:
        assert list(ax.get_xticks()) == [1.0, 4.0, 16.0] and ax.get_xscale() == "log"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "4", "16"]
    for figure in figures:
        for ax in figure.axes:
            legend = {t.get_text() for t in ax.get_legend().get_texts()}
            assert {line.get_label() for line in ax.get_lines()} == legend
    labels = [{t.get_text() for t in ax.get_legend().get_texts()} for ax in sweep.axes]
    assert "goodput (met the SLO)" in labels[1]
    assert "SLO ttft 120 ms" in labels[2] and "SLO itl 20 ms" in labels[3]
    assert "SLO ttft 120 ms" in {t.get_text() for t in cdfs.axes[0].get_legend().get_texts()}


def test_trace_replays_compare_by_their_replay_settings():
    def trace(time_scale: float) -> dict:
        result = make_result(0.1, seed=1)
        result.update(workload={"trace": "t.jsonl"}, tokens_per_word=None, tokenizer="token ids",
                      trace={"file": "t.jsonl", "window": "0:60", "time_scale": time_scale, "block_tokens": 16,
                             "trace_block_tokens": 512, "max_output_tokens": None})
        return result

    assert workload_differences(trace(1.0), trace(1.0)) == []
    assert workload_differences(trace(1.0), trace(2.0)) == ["--time-scale: 1.0 vs 2.0"]
    assert "prompts: deployment vs token ids" in workload_differences(make_result(0.1, seed=1), trace(1.0))
