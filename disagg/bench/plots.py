"""PNG plots of a results file (matplotlib, headless): latency CDFs, the sweep, per-turn TTFT, A vs B.

Each function takes results as ``report.load_result`` returns them and writes one PNG.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_latency_cdfs", "plot_sweep", "plot_turns", "plot_compare", "write_plots"]

_LATENCIES = (("ttft", "TTFT"), ("itl", "inter-token latency"), ("tpot", "TPOT"), ("e2e", "end-to-end"))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def _label(run: dict[str, Any]) -> str:
    return f"{'c' if run['mode'] == 'concurrency' else 'rate'}={run['level']:g}"


def _values(run: dict[str, Any], name: str) -> list[float]:
    records = [r for r in run["records"] if r["error_kind"] is None]
    if name == "itl":
        return sorted(g * 1e3 for r in records for g in r["itls"])
    if name == "tpot":
        values = [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in records
                  if r["output_tokens"] > 1 and r["ttft"] is not None]
    else:
        values = [r[name] for r in records if r[name] is not None]
    return sorted(v * 1e3 for v in values)


def plot_latency_cdfs(result: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (name, title) in zip(axes.flat, _LATENCIES):
        for run in result["runs"]:
            values = _values(run, name)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=_label(run))
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests" if name != "itl" else "fraction of gaps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{result['url']} ({result['api']}): latency CDFs")
    return _save(fig, path)


def _levels(result: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    return sorted((r for r in result["runs"] if r["mode"] == mode), key=lambda r: r["level"])


def plot_sweep(result: dict[str, Any], path: Path) -> Path:
    """Throughput and TTFT against concurrency (and against rate for open-loop levels)."""
    plt = _pyplot()
    modes = [m for m in ("concurrency", "rate") if _levels(result, m)]
    fig, axes = plt.subplots(len(modes), 2, figsize=(11, 4 * len(modes)), squeeze=False)
    for row, mode in zip(axes, modes):
        runs = _levels(result, mode)
        x = [r["level"] for r in runs]
        row[0].plot(x, [r["output_tokens_per_s"] for r in runs], "o-", label="output tok/s")
        twin = row[0].twinx()
        twin.plot(x, [r["requests_per_s"] for r in runs], "s--", color="tab:orange", label="req/s")
        row[0].set(xlabel=mode, ylabel="output tokens/s", title=f"throughput vs {mode}")
        twin.set_ylabel("requests/s")
        lines = row[0].get_lines() + twin.get_lines()
        row[0].legend(lines, [line.get_label() for line in lines], fontsize="small")
        for q in ("p50", "p90", "p99"):
            row[1].plot(x, [(r["ttft"][q] or 0) * 1e3 for r in runs], "o-", label=f"TTFT {q}")
        row[1].set(xlabel=mode, ylabel="ms", title=f"TTFT vs {mode}")
        row[1].legend(fontsize="small")
        for ax in row:
            ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_turns(result: dict[str, Any], path: Path) -> Path:
    """TTFT p50 per turn of a session, beside the prompt it carried: the prefix cache's effect."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    twin = ax.twinx()
    for run in result["runs"]:
        by_turn = run["ttft_p50_by_turn"]
        turns = sorted(int(t) for t in by_turn)
        line, = ax.plot(turns, [by_turn[str(t)] * 1e3 for t in turns], "o-", label=f"TTFT p50 {_label(run)}")
        prompts = [[r["prompt_tokens"] for r in run["records"] if r["turn"] == t and r["prompt_tokens"]]
                   for t in turns]
        twin.plot(turns, [sum(p) / len(p) if p else 0 for p in prompts], ":", color=line.get_color())
    ax.set(xlabel="turn of the session", ylabel="TTFT p50 (ms)",
           title="TTFT per turn (solid) vs prompt tokens (dotted)")
    twin.set_ylabel("prompt tokens (mean)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_compare(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str], path: Path) -> Path:
    """Two results side by side: TTFT p50, ITL p50 and output tok/s at each level."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (("TTFT p50 (ms)", lambda r: (r["ttft"]["p50"] or 0) * 1e3),
              ("ITL p50 (ms)", lambda r: (r["itl"]["p50"] or 0) * 1e3),
              ("output tokens/s", lambda r: r["output_tokens_per_s"]))
    for ax, (title, value) in zip(axes, panels):
        for result, name in ((a, names[0]), (b, names[1])):
            runs = sorted(result["runs"], key=lambda r: (r["mode"], r["level"]))
            ax.plot([_label(r) for r in runs], [value(r) for r in runs], "o-", label=name)
        ax.set(title=title, xlabel="level")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_plots(result: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """The latency CDFs; the sweep when the file has concurrency or rate levels (a trace replay has
    neither), and TTFT per turn when requests come in sessions."""
    plots = [plot_latency_cdfs(result, out_dir / f"{stem}-latency-cdf.png")]
    if _levels(result, "concurrency") or _levels(result, "rate"):
        plots.append(plot_sweep(result, out_dir / f"{stem}-sweep.png"))
    if any(r["mode"] != "trace" for r in result["runs"]):
        plots.append(plot_turns(result, out_dir / f"{stem}-turns.png"))
    return plots
