"""``disagg bench compare A.json B.json``: the runs of two results files side by side, and a PNG.

Runs are matched by (mode, level); each line prints A, B and B/A for TTFT p50, ITL p50 and
output tokens/s. Levels only one file has are listed as such.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["compare_lines", "matched_runs"]

_FIGURES = (("TTFT p50 ms", lambda r: r["ttft"]["p50"] and r["ttft"]["p50"] * 1e3),
            ("ITL p50 ms", lambda r: r["itl"]["p50"] and r["itl"]["p50"] * 1e3),
            ("out tok/s", lambda r: r["output_tokens_per_s"]),
            ("req/s", lambda r: r["requests_per_s"]))


def matched_runs(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, dict | None, dict | None]]:
    key = lambda r: (r["mode"], r["level"])  # noqa: E731
    runs_a, runs_b = {key(r): r for r in a["runs"]}, {key(r): r for r in b["runs"]}
    return [(f"{mode} {level:g}", runs_a.get((mode, level)), runs_b.get((mode, level)))
            for mode, level in sorted(set(runs_a) | set(runs_b))]


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def compare_lines(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str]) -> list[str]:
    lines = [f"A = {names[0]} ({a['url']}, {a['api']})", f"B = {names[1]} ({b['url']}, {b['api']})"]
    for label, run_a, run_b in matched_runs(a, b):
        if run_a is None or run_b is None:
            lines.append(f"{label}: only in {'B' if run_a is None else 'A'}")
            continue
        lines.append(f"{label}:")
        for name, value in _FIGURES:
            va, vb = value(run_a), value(run_b)
            ratio = f"{vb / va:.2f}x" if va and vb is not None else "-"
            lines.append(f"  {name:12s} A {_fmt(va):>10s}  B {_fmt(vb):>10s}  B/A {ratio}")
    return lines


def compare_stem(path_a: str, path_b: str) -> str:
    return f"compare-{Path(path_a).stem}-vs-{Path(path_b).stem}"
