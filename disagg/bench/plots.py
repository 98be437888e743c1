"""PNG plots of a results file (matplotlib, headless): latency CDFs, the sweep, per-turn TTFT, A vs B.

Each function takes results as ``report.load_result`` returns them and writes one PNG. Conventions
every plot keeps: an x axis of levels has its ticks at the measured levels (a log axis when they
span 8x or more, as 1,4,16,64 do); every line is in a legend, outside the axes when it could hide a
line; the ``--slo`` bounds are drawn where their figure is; each quantity has its own axes (two
series on twin axes hid one behind the other whenever their shapes matched).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_latency_cdfs", "plot_sweep", "plot_turns", "plot_compare", "write_plots"]

_LATENCIES = (("ttft", "TTFT"), ("itl", "inter-token latency"), ("tpot", "TPOT"), ("e2e", "end-to-end"))
# The --slo keys that bound each latency (metrics.meets_slo: itl and tpot both bound a request's TPOT;
# none bounds the single gaps of the ITL plot).
_SLO_KEYS = {"ttft": ("ttft",), "tpot": ("itl", "tpot"), "e2e": ("e2e",), "itl": ()}
_MODES = ("concurrency", "rate")


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


def _slo_lines(ax: Any, slo: dict[str, float], latency: str, vertical: bool) -> None:
    """A dashed black line (with its legend entry) at each --slo bound on ``latency``, in ms."""
    for key in _SLO_KEYS[latency]:
        if key in slo:
            draw = ax.axvline if vertical else ax.axhline
            draw(slo[key] * 1e3, color="black", linestyle="--", linewidth=1, label=f"SLO {key} {slo[key] * 1e3:g} ms")


def _level_axis(ax: Any, levels: list[float], mode: str) -> None:
    """Ticks at exactly the measured levels, labelled as given on the command line."""
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    if levels and min(levels) > 0 and max(levels) / min(levels) >= 8:
        ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(levels))
    ax.xaxis.set_major_formatter(FixedFormatter([f"{v:g}" for v in levels]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel({"concurrency": "concurrency (sessions in flight)", "rate": "rate (sessions/s)"}.get(
        mode, "trace time scale"))


def _legend(ax: Any, outside: bool = False) -> None:
    if outside:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    else:
        ax.legend(fontsize="small")


def plot_latency_cdfs(result: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (name, title) in zip(axes.flat, _LATENCIES):
        for run in result["runs"]:
            values = _values(run, name)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=_label(run))
        _slo_lines(ax, result.get("slo") or {}, name, vertical=True)
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests" if name != "itl" else "fraction of gaps")
        ax.grid(alpha=0.3)
        _legend(ax)
    fig.suptitle(f"{result['url']} ({result['api']}): latency CDFs")
    return _save(fig, path)


def _runs(result: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    return sorted((r for r in result["runs"] if r["mode"] == mode), key=lambda r: r["level"])


def _ms(run: dict[str, Any], name: str, q: str) -> float:
    value = run[name][q]
    return float("nan") if value is None else value * 1e3  # NaN: a gap in the line, not a false 0


def plot_sweep(result: dict[str, Any], path: Path) -> Path:
    """Per mode, against its levels: output tokens/s; requests/s and goodput; TTFT and TPOT
    percentiles with the SLO bounds."""
    plt = _pyplot()
    modes = [m for m in _MODES if _runs(result, m)]
    slo = result.get("slo") or {}
    fig, axes = plt.subplots(len(modes), 4, figsize=(20, 4.2 * len(modes)), squeeze=False)
    for row, mode in zip(axes, modes):
        runs = _runs(result, mode)
        x = [r["level"] for r in runs]
        row[0].plot(x, [r["output_tokens_per_s"] for r in runs], "o-", label="output tokens/s")
        row[0].set(ylabel="output tokens/s", title=f"output throughput vs {mode}")
        row[1].plot(x, [r["requests_per_s"] for r in runs], "o-", label="requests/s (all ok)")
        if slo:
            row[1].plot(x, [r["goodput_requests_per_s"] for r in runs], "s--", label="goodput (met the SLO)")
        row[1].set(ylabel="requests/s", title=f"requests and goodput vs {mode}", ylim=(0, None))
        for ax, name, title in ((row[2], "ttft", "TTFT"), (row[3], "tpot", "TPOT")):
            for q in ("p50", "p90", "p99"):
                ax.plot(x, [_ms(r, name, q) for r in runs], "o-", label=f"{title} {q}")
            _slo_lines(ax, slo, name, vertical=False)
            ax.set(ylabel="ms", title=f"{title} vs {mode}")
        for ax in row:
            _level_axis(ax, x, mode)
            ax.grid(alpha=0.3)
            _legend(ax)
    return _save(fig, path)


def plot_turns(result: dict[str, Any], path: Path) -> Path:
    """TTFT p50 per turn of a session (top) above the prompt it carried (bottom): the prefix
    cache's effect is a flat top line while the bottom one climbs."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for run in result["runs"]:
        by_turn = run["ttft_p50_by_turn"]
        turns = sorted(int(t) for t in by_turn)
        line, = top.plot(turns, [by_turn[str(t)] * 1e3 for t in turns], "o-", label=_label(run))
        prompts = [[r["prompt_tokens"] for r in run["records"] if r["turn"] == t and r["prompt_tokens"]]
                   for t in turns]
        bottom.plot(turns, [sum(p) / len(p) if p else float("nan") for p in prompts], "o:",
                    color=line.get_color(), label=_label(run))
    _slo_lines(top, result.get("slo") or {}, "ttft", vertical=False)
    top.set(ylabel="TTFT p50 (ms)", title="TTFT per turn of a session, and the prompt it carried")
    bottom.set(xlabel="turn of the session", ylabel="prompt tokens (mean)")
    bottom.xaxis.get_major_locator().set_params(integer=True)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        _legend(ax, outside=True)
    return _save(fig, path)


def plot_compare(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str], path: Path) -> Path:
    """Two results against the levels of each mode: TTFT p50, ITL p50 and output tokens/s."""
    plt = _pyplot()
    modes = [m for m in (*_MODES, "trace") if _runs(a, m) or _runs(b, m)]
    fig, axes = plt.subplots(len(modes), 3, figsize=(17, 4.5 * len(modes)), squeeze=False)
    panels = (("TTFT p50 (ms)", "ttft", lambda r: _ms(r, "ttft", "p50")),
              ("ITL p50 (ms)", "itl", lambda r: _ms(r, "itl", "p50")),
              ("output tokens/s", None, lambda r: r["output_tokens_per_s"]))
    slo = (a.get("slo") or {}) if a.get("slo") == b.get("slo") else {}
    for row, mode in zip(axes, modes):
        levels = sorted({r["level"] for r in _runs(a, mode) + _runs(b, mode)})
        for ax, (title, latency, value) in zip(row, panels):
            for result, name, marker in ((a, f"A: {names[0]}", "o-"), (b, f"B: {names[1]}", "s--")):
                runs = _runs(result, mode)
                ax.plot([r["level"] for r in runs], [value(r) for r in runs], marker, label=name)
            if latency:
                _slo_lines(ax, slo, latency, vertical=False)
            ax.set(title=f"{title} vs {mode}")
            _level_axis(ax, levels, mode)
            ax.grid(alpha=0.3)
            _legend(ax)
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
    if _runs(result, "concurrency") or _runs(result, "rate"):
        plots.append(plot_sweep(result, out_dir / f"{stem}-sweep.png"))
    if any(r["mode"] != "trace" for r in result["runs"]):
        plots.append(plot_turns(result, out_dir / f"{stem}-turns.png"))
    return plots
