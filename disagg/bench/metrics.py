"""Per-request records and per-run summaries: TTFT, ITL, TPOT, E2E, throughput, goodput, percentiles.

Definitions (times in seconds; the JSON holds them as they are):

- TTFT: request sent -> first chunk that carries generated text.
- ITL: the gap between consecutive text-carrying chunks (vLLM's ``bench serve`` definition); one
  token per chunk unless the server coalesces (``stream_interval``).
- TPOT: (E2E - TTFT) / (output tokens - 1) per request (aiperf and genai-perf call this their
  inter-token latency); output tokens from the usage fields, else the chunk count.
- Cached fraction: the requests' cached prompt tokens (from the usage) over their prompt tokens, the
  prefix cache's share of the prompt work; None when the server reports no cached tokens.
- Goodput: requests/s of the requests that met every SLO (``--slo ttft=2s,itl=50ms,e2e=10s``;
  ``itl`` and ``tpot`` both bound the request's TPOT).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["RequestRecord", "RunSummary", "Distribution", "percentile", "summarize", "parse_slo", "meets_slo", "PERCENTILES"]

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    session_id: int
    turn: int
    start: float
    """Seconds since the run started."""
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    error_kind: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); ``values`` sorted, non-empty."""
    rank = (len(values) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return values[low] + (values[high] - values[low]) * (rank - low)


@dataclass
class Distribution:
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    min: float | None
    max: float | None

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Distribution:
        data = sorted(v for v in values if v is not None)
        if not data:
            return cls(0, None, None, None, None, None, None)
        p50, p90, p99 = (percentile(data, q) for q in PERCENTILES)
        return cls(len(data), sum(data) / len(data), p50, p90, p99, data[0], data[-1])


@dataclass
class RunSummary:
    mode: str  # "concurrency", "rate" or "trace"
    level: float
    """The concurrency, the arrival rate in sessions/s, or a trace replay's time scale."""
    num_requests: int
    num_ok: int
    errors_by_kind: dict[str, int]
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    goodput_requests_per_s: float | None
    ttft: Distribution
    itl: Distribution
    tpot: Distribution
    e2e: Distribution
    prompt_tokens: Distribution
    output_tokens: Distribution
    cached_tokens: Distribution
    cached_fraction: float | None
    ttft_p50_by_turn: dict[str, float]
    """TTFT p50 of each turn index: flat as the context grows when the prefix cache works."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft=2s,itl=50ms`` -> ``{"ttft": 2.0, "itl": 0.05}``; ValueError naming --slo otherwise."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        key, _, value = part.strip().partition("=")
        if key not in ("ttft", "itl", "tpot", "e2e") or not value:
            raise ValueError(f"--slo: expected KEY=DURATION with KEY in ttft, itl, tpot, e2e, got {part!r}")
        scale = 1e-3 if value.endswith("ms") else 1.0
        number = value[:-2] if value.endswith("ms") else value.rstrip("s")
        try:
            slo[key] = float(number) * scale
        except ValueError:
            raise ValueError(f"--slo: {key}: expected a duration like 2s or 50ms, got {value!r}") from None
        if slo[key] <= 0:
            raise ValueError(f"--slo: {key}: must be > 0, got {value!r}")
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether a request counts towards goodput: it succeeded and met every bound of ``slo``."""
    values = {"ttft": record.ttft, "e2e": record.e2e, "itl": record.tpot, "tpot": record.tpot}
    if not record.ok:
        return False
    for key, bound in slo.items():
        value = values[key]  # None: not measured (no token came), which no SLO fails
        if value is not None and value > bound:
            return False
    return True


def _cached_fraction(records: list[RequestRecord]) -> float | None:
    reported = [r for r in records if r.cached_tokens is not None and r.prompt_tokens]
    if not reported:
        return None
    return sum(r.cached_tokens or 0 for r in reported) / sum(r.prompt_tokens or 0 for r in reported)


def summarize(records: list[RequestRecord], mode: str, level: float, duration: float,
              slo: dict[str, float]) -> RunSummary:
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if r.error_kind:
            errors[r.error_kind] = errors.get(r.error_kind, 0) + 1
    by_turn: dict[int, list[float]] = {}
    for r in ok:
        if r.ttft is not None:
            by_turn.setdefault(r.turn, []).append(r.ttft)
    duration = max(duration, 1e-9)
    return RunSummary(
        mode=mode, level=level, num_requests=len(records), num_ok=len(ok), errors_by_kind=errors,
        duration_s=duration, requests_per_s=len(ok) / duration,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / duration,
        goodput_requests_per_s=sum(meets_slo(r, slo) for r in ok) / duration if slo else None,
        ttft=Distribution.of(r.ttft for r in ok), itl=Distribution.of(g for r in ok for g in r.itls),
        tpot=Distribution.of(r.tpot for r in ok), e2e=Distribution.of(r.e2e for r in ok),
        prompt_tokens=Distribution.of(r.prompt_tokens for r in ok),
        output_tokens=Distribution.of(r.output_tokens for r in ok),
        cached_tokens=Distribution.of(r.cached_tokens for r in ok), cached_fraction=_cached_fraction(ok),
        ttft_p50_by_turn={str(t): percentile(sorted(v), 50) for t, v in sorted(by_turn.items())})
