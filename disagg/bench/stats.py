"""Confidence intervals for ``disagg bench compare``: is B - A signal, or noise?

Two methods, each chosen for what the figure is:

- **Medians (TTFT, TPOT, E2E, ITL p50): percentile bootstrap of the difference B - A**, resampling
  whole requests of each run with replacement (``BOOTSTRAP_RESAMPLES`` times, a fixed seed, so the
  same files always print the same interval). Latency distributions are skewed and often
  bimodal (a prefill that waits behind another), so a t-interval on means would answer a
  different question, and a median has no simple standard error; the bootstrap needs neither.
  ITL gaps are resampled by the request they belong to (a cluster bootstrap): the gaps of one
  request share its batch and are not independent.
- **Throughputs (output tokens/s, requests/s): a Welch t-interval on the difference of mean rates
  over time windows** (batch means). A level yields one throughput, so the records are cut into
  equal windows of the level's duration by completion time; the mean of the window rates is the
  level's throughput, and their spread is its noise.

Both treat a run's requests (or windows) as independent, which they are not quite: requests share
the server's queue. The intervals are therefore a lower bound on the run-to-run noise; repeat
runs when a decision hangs on a few percent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Interval", "BOOTSTRAP_RESAMPLES", "LEVEL", "weighted_median", "median_difference",
           "window_rates", "welch_difference", "t_quantile"]

BOOTSTRAP_RESAMPLES = 2000
LEVEL = 0.95
_SEED = 20260


@dataclass(frozen=True)
class Interval:
    """A 95% interval of B - A, and the point estimate it brackets."""

    difference: float
    low: float
    high: float

    @property
    def within_noise(self) -> bool:
        return self.low <= 0.0 <= self.high


def weighted_median(sorted_values: np.ndarray, weights: np.ndarray) -> float:
    """The lower median of ``sorted_values`` where each value counts ``weights`` times."""
    cumulative = np.cumsum(weights)
    return float(sorted_values[np.searchsorted(cumulative, cumulative[-1] / 2.0)])


class _Resampler:
    """One run's requests, each a group of values (one value, or a request's ITL gaps), ready to
    draw bootstrap medians from: a resample is a count per request, expanded over its values."""

    def __init__(self, groups: Sequence[Sequence[float]]) -> None:
        kept = [g for g in groups if len(g)]
        values = np.concatenate([np.asarray(g, dtype=float) for g in kept]) if kept else np.empty(0)
        owners = np.repeat(np.arange(len(kept)), [len(g) for g in kept])
        order = np.argsort(values, kind="stable")
        self.num_groups = len(kept)
        self.values, self.owners = values[order], owners[order]

    def medians(self, rng: np.random.Generator, resamples: int) -> np.ndarray:
        """``resamples`` bootstrap medians, computed a chunk of resamples at a time (a chunk holds
        about 4M weights whatever the number of values)."""
        n, out = self.num_groups, []
        chunk = max(1, min(resamples, 4_000_000 // max(1, len(self.values))))
        for start in range(0, resamples, chunk):
            rows = min(chunk, resamples - start)
            draws = rng.integers(0, n, (rows, n)) + n * np.arange(rows)[:, None]
            counts = np.bincount(draws.ravel(), minlength=rows * n).reshape(rows, n)
            cumulative = np.cumsum(counts[:, self.owners], axis=1)  # (rows, values)
            half = cumulative[:, -1:] / 2.0
            out.append(self.values[np.argmax(cumulative >= half, axis=1)])
        return np.concatenate(out)


def median_difference(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]],
                      resamples: int = BOOTSTRAP_RESAMPLES) -> Interval | None:
    """The bootstrap interval of median(B) - median(A); ``a`` and ``b`` hold one group of values
    per request. None with fewer than 5 requests on either side (no interval worth printing)."""
    runs = _Resampler(a), _Resampler(b)
    if min(r.num_groups for r in runs) < 5:
        return None
    rng = np.random.default_rng(_SEED)
    diffs = runs[1].medians(rng, resamples) - runs[0].medians(rng, resamples)
    tail = (1.0 - LEVEL) / 2.0 * 100.0
    point = (weighted_median(runs[1].values, np.ones(len(runs[1].values)))
             - weighted_median(runs[0].values, np.ones(len(runs[0].values))))
    return Interval(point, float(np.percentile(diffs, tail)), float(np.percentile(diffs, 100.0 - tail)))


def window_rates(completions: Sequence[tuple[float, float]], duration: float,
                 max_windows: int = 10) -> list[float]:
    """``completions`` are (time since the level started, amount) pairs; the rate of each of ``k``
    equal windows of ``duration``, k = min(max_windows, n // 5) (empty below 3 windows: too few
    completions to tell a window's rate from chance)."""
    k = min(max_windows, len(completions) // 5)
    if k < 3 or duration <= 0:
        return []
    width = duration / k
    sums = [0.0] * k
    for when, amount in completions:
        sums[min(k - 1, max(0, int(when / width)))] += amount
    return [s / width for s in sums]


# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom; above 30 the normal 1.96
# would be a little narrow, so 31..120 use 2.04 (t at 30) and more than 120 use 1.98 (t at 120).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t_quantile(df: float) -> float:
    """The 97.5% quantile of t with ``df`` degrees of freedom, rounded down to a whole df (wider)."""
    whole = max(1, math.floor(df))
    if whole <= len(_T975):
        return _T975[whole - 1]
    return 2.042 if whole <= 120 else 1.980


def welch_difference(a: Sequence[float], b: Sequence[float]) -> Interval | None:
    """Welch's 95% t-interval of mean(B) - mean(A); None with fewer than 3 values on either side."""
    if min(len(a), len(b)) < 3:
        return None
    mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
    var_a = sum((x - mean_a) ** 2 for x in a) / (len(a) - 1) / len(a)
    var_b = sum((x - mean_b) ** 2 for x in b) / (len(b) - 1) / len(b)
    se = math.sqrt(var_a + var_b)
    diff = mean_b - mean_a
    if se == 0.0:
        return Interval(diff, diff, diff)
    df = se ** 4 / (var_a ** 2 / (len(a) - 1) + var_b ** 2 / (len(b) - 1))  # Welch-Satterthwaite
    half = t_quantile(df) * se
    return Interval(diff, diff - half, diff + half)
