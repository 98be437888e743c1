"""The results file: one JSON document per ``disagg bench`` run, and the lines printed at the end.

    {"format": "disagg-bench/1", "created", "url", "api", "model", "ignore_eos", "workload": {...},
     "tokens_per_word", "tokenizer": "deployment" | "estimate", "slo": {...},
     "server": {"version", "cluster_info", "server_info", "models"} (server_info.py; each null when absent),
     "runs": [{<metrics.RunSummary fields>, "records": [<metrics.RequestRecord fields>, ...]}, ...]}

``compare`` and the plots read only this file, so results from two machines or two servers can
be compared later.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from disagg.bench.runner import BenchPlan, LevelResult
from disagg.bench.text import ESTIMATED_TOKENS_PER_WORD, TextSource

__all__ = ["FORMAT", "build_result", "write_result", "load_result", "summary_lines"]

FORMAT = "disagg-bench/1"


def build_result(plan: BenchPlan, results: list[LevelResult], text: TextSource,
                 server: dict[str, Any] | None = None) -> dict[str, Any]:
    workload = {k: str(v) if not isinstance(v, (int, float)) else v
                for k, v in dataclasses.asdict(plan.workload).items()}
    workload.update(isl=str(plan.workload.isl), osl=str(plan.workload.osl), turns=str(plan.workload.turns))
    return {
        "format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "url": plan.url,
        "api": plan.api.name, "model": plan.api.model, "ignore_eos": plan.api.ignore_eos, "workload": workload,
        "num_requests": plan.num_requests, "duration": plan.duration, "warmup": plan.warmup,
        "tokens_per_word": text.tokens_per_word,
        "tokenizer": "estimate" if text.tokens_per_word == ESTIMATED_TOKENS_PER_WORD else "deployment",
        "slo": plan.slo, "server": server,
        "runs": [{**r.summary.to_dict(), "records": [dataclasses.asdict(rec) for rec in r.records]} for r in results],
    }


def write_result(result: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


def load_result(path: str | Path) -> dict[str, Any]:
    """A results file; ValueError naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read a results file: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a disagg bench results file (format {FORMAT})")
    return data


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def summary_lines(run: dict[str, Any]) -> list[str]:
    """A run's figures, one line of throughput and one per latency metric."""
    errors = ", ".join(f"{k} {v}" for k, v in sorted(run["errors_by_kind"].items())) or "none"
    goodput = "" if run["goodput_requests_per_s"] is None else f"  goodput {run['goodput_requests_per_s']:.2f} req/s"
    lines = [f"{run['mode']} {run['level']:g}: {run['num_ok']}/{run['num_requests']} ok in {run['duration_s']:.1f} s, "
             f"{run['requests_per_s']:.2f} req/s, {run['output_tokens_per_s']:.1f} output tok/s{goodput}; "
             f"errors: {errors}"]
    for name in ("ttft", "itl", "tpot", "e2e"):
        d = run[name]
        lines.append(f"  {name:5s} ms  p50 {_ms(d['p50']):>8s}  p90 {_ms(d['p90']):>8s}  p99 {_ms(d['p99']):>8s}"
                     f"  mean {_ms(d['mean']):>8s}  (n={d['count']})")
    tokens = run["prompt_tokens"], run["output_tokens"], run["cached_tokens"]
    lines.append("  tokens  in p50 {}  out p50 {}  cached p50 {}".format(
        *("-" if t["p50"] is None else f"{t['p50']:.0f}" for t in tokens)))
    return lines
