"""``disagg bench compare A.json B.json``: two results files, level by level, signal or noise.

``workload_differences`` lists what makes two files not comparable (API, model, levels, lengths,
session shape, SLO, prompt text, a trace and how it was replayed); the command refuses such a pair unless ``--force``. Runs are
matched by (mode, level); each line prints A, B, B/A and the 95% interval of B - A from the
per-request records (``stats``), then ``within noise`` when the interval holds 0, else which way
B moved. Levels only one file has are listed as such.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg.bench import stats
from disagg.bench.metrics import RequestRecord, meets_slo

__all__ = ["compare_lines", "matched_runs", "workload_differences", "compare_stem", "METHOD_NOTE"]

METHOD_NOTE = (f"95% intervals of B - A: medians by a bootstrap over requests ({stats.BOOTSTRAP_RESAMPLES} "
               "resamples), throughputs by Welch's t over time windows; they hold the noise within each run, "
               "and a busy machine drifts more than that between runs (docs/operations.md)")

# Prompts are words; a tokenizer that makes 5% more tokens of them is a different workload.
_TOKENS_PER_WORD_TOLERANCE = 0.05


@dataclass(frozen=True)
class _Figure:
    name: str
    summary: Callable[[dict[str, Any]], float | None]
    """The figure as the run's summary states it (what the A and B columns print)."""
    groups: Callable[[list[RequestRecord]], list[list[float]]] | None = None
    """Per-request values of a median figure (bootstrap); None: a throughput (time windows)."""
    amount: Callable[[RequestRecord, dict[str, float]], float] | None = None
    """A throughput's amount per completed request."""
    lower_is_better: bool = True


def _ms(name: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda run: None if run[name]["p50"] is None else run[name]["p50"] * 1e3


def _one(value: Callable[[RequestRecord], float | None]) -> Callable[[list[RequestRecord]], list[list[float]]]:
    return lambda records: [[v * 1e3] for r in records if (v := value(r)) is not None]


_FIGURES = (
    _Figure("TTFT p50 ms", _ms("ttft"), _one(lambda r: r.ttft)),
    _Figure("TPOT p50 ms", _ms("tpot"), _one(lambda r: r.tpot)),
    _Figure("ITL p50 ms", _ms("itl"), lambda records: [[g * 1e3 for g in r.itls] for r in records]),
    _Figure("E2E p50 ms", _ms("e2e"), _one(lambda r: r.e2e)),
    _Figure("out tok/s", lambda run: run["output_tokens_per_s"], amount=lambda r, slo: r.output_tokens,
            lower_is_better=False),
    _Figure("req/s", lambda run: run["requests_per_s"], amount=lambda r, slo: 1.0, lower_is_better=False),
    _Figure("goodput req/s", lambda run: run["goodput_requests_per_s"],
            amount=lambda r, slo: float(meets_slo(r, slo)), lower_is_better=False),
)


def matched_runs(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, dict | None, dict | None]]:
    key = lambda r: (r["mode"], r["level"])  # noqa: E731
    runs_a, runs_b = {key(r): r for r in a["runs"]}, {key(r): r for r in b["runs"]}
    return [(f"{mode} {level:g}", runs_a.get((mode, level)), runs_b.get((mode, level)))
            for mode, level in sorted(set(runs_a) | set(runs_b))]


def _levels(result: dict[str, Any]) -> str:
    levels = sorted((r["mode"], r["level"]) for r in result["runs"])
    return "; ".join(f"{mode} " + ", ".join(f"{lv:g}" for m, lv in levels if m == mode)
                     for mode in sorted({m for m, _ in levels})) or "none"


def _slo(result: dict[str, Any]) -> str:
    return ",".join(f"{key}={bound * 1e3:g}ms" for key, bound in (result.get("slo") or {}).items()) or "none"


def workload_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What the two runs did differently, one line each; empty when they ran the same workload.
    The seed is left out: it picks other prompts of the same shape."""
    differences = [f"{label}: {a[key]!r} vs {b[key]!r}" for key, label in (("api", "--api"), ("model", "model"))
                   if a[key] != b[key]]
    if None not in (a.get("ignore_eos"), b.get("ignore_eos")) and a["ignore_eos"] != b["ignore_eos"]:
        differences.append(f"--ignore-eos: {a['ignore_eos']} vs {b['ignore_eos']}")  # absent in older files
    if _levels(a) != _levels(b):
        differences.append(f"levels: {_levels(a)} vs {_levels(b)}")
    wa, wb = a["workload"], b["workload"]
    differences += [f"--{key.replace('_', '-')}: {wa.get(key)} vs {wb.get(key)}"
                    for key in sorted((set(wa) | set(wb)) - {"seed"}) if wa.get(key) != wb.get(key)]
    if (a.get("slo") or {}) != (b.get("slo") or {}):
        differences.append(f"--slo: {_slo(a)} vs {_slo(b)} (goodput is not comparable)")
    tpw_a, tpw_b = a.get("tokens_per_word"), b.get("tokens_per_word")  # None: a trace's token ids
    if tpw_a is None or tpw_b is None:
        if a["tokenizer"] != b["tokenizer"]:
            differences.append(f"prompts: {a['tokenizer']} vs {b['tokenizer']}")
    elif abs(tpw_b - tpw_a) > _TOKENS_PER_WORD_TOLERANCE * tpw_a:
        differences.append(f"prompt text: {tpw_a:.3f} vs {tpw_b:.3f} tokens per word (tokenizer "
                           f"{a['tokenizer']} vs {b['tokenizer']}): the same token counts are different prompts")
    trace_a, trace_b = a.get("trace") or {}, b.get("trace") or {}
    differences += [f"--{key.replace('_', '-')}: {trace_a.get(key)} vs {trace_b.get(key)}"
                    for key in ("window", "time_scale", "block_tokens", "trace_block_tokens", "max_output_tokens")
                    if trace_a.get(key) != trace_b.get(key)]
    return differences


def _records(run: dict[str, Any]) -> list[RequestRecord]:
    return [record for r in run["records"] if (record := RequestRecord(**r)).ok]


def _interval(figure: _Figure, run_a: dict[str, Any], run_b: dict[str, Any],
              slo: dict[str, float]) -> stats.Interval | None:
    records_a, records_b = _records(run_a), _records(run_b)
    if figure.groups is not None:
        return stats.median_difference(figure.groups(records_a), figure.groups(records_b))
    assert figure.amount is not None
    amount = figure.amount
    rates = [stats.window_rates([(r.start + (r.e2e or 0.0), amount(r, slo)) for r in records], run["duration_s"])
             for records, run in ((records_a, run_a), (records_b, run_b))]
    return stats.welch_difference(*rates)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _verdict(figure: _Figure, interval: stats.Interval | None) -> str:
    if interval is None:
        return "too few requests for an interval"
    if interval.within_noise:
        return "within noise"
    lower = interval.high < 0
    return f"B {'lower' if lower else 'higher'} ({'better' if lower == figure.lower_is_better else 'worse'})"


def _header(name: str, result: dict[str, Any]) -> str:
    version = ((result.get("server") or {}).get("version") or {}).get("version")
    server = f", server {version}" if version else ""
    return f"{name} ({result['url']}, {result['api']}, model {result['model']}{server})"


def compare_lines(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str]) -> list[str]:
    lines = [f"A = {_header(names[0], a)}", f"B = {_header(names[1], b)}", METHOD_NOTE]
    slo = a.get("slo") or {}
    figures = [f for f in _FIGURES if f.name != "goodput req/s" or (slo and slo == b.get("slo"))]
    for label, run_a, run_b in matched_runs(a, b):
        if run_a is None or run_b is None:
            lines.append(f"{label}: only in {'B' if run_a is None else 'A'}")
            continue
        lines.append(f"{label} (A {run_a['num_ok']} ok, B {run_b['num_ok']} ok):")
        lines.append(f"  {'figure':14s} {'A':>10s} {'B':>10s} {'B/A':>7s}  {'B-A 95% interval':24s} verdict")
        for figure in figures:
            va, vb = figure.summary(run_a), figure.summary(run_b)
            ratio = f"{vb / va:.2f}x" if va and vb is not None else "-"
            interval = _interval(figure, run_a, run_b, slo)
            span = "-" if interval is None else f"[{interval.low:+.2f}, {interval.high:+.2f}]"
            lines.append(f"  {figure.name:14s} {_fmt(va):>10s} {_fmt(vb):>10s} {ratio:>7s}  {span:24s} "
                         f"{_verdict(figure, interval)}")
    return lines


def compare_stem(path_a: str, path_b: str) -> str:
    return f"compare-{Path(path_a).stem}-vs-{Path(path_b).stem}"
