"""Which engine rank holds which KV heads: the layout a ctx worker advertises, and the pull plan.

A one-rank engine's KV endpoint is ``tcp://host:port`` (every KV head). A
tensor-parallel torch engine advertises every rank, rank 0 first (its KV
agent, which also takes the acks), in the one signed ``kv_endpoint`` string::

    tcp://host:port;kv=0-2,tcp://host2:port2;kv=2-4

(rank i's endpoint; ``kv=a-b``: it holds KV heads [a, b) of the model). The
ctx params sign this string, so a gen worker trusts every endpoint and head
range in it. ``plan_pulls`` gives each gen rank the (ctx endpoint, heads)
pieces it pulls, each KV head from exactly one ctx rank. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RankKV", "format_layout", "parse_layout", "PullSource", "plan_pulls", "is_single_rank"]


@dataclass(frozen=True)
class RankKV:
    endpoint: str  # tcp://host:port of the rank's KV server (rank 0: its KV agent)
    kv_heads: range  # the model's KV heads this rank holds


def format_layout(ranks: list[RankKV]) -> str:
    return ",".join(f"{r.endpoint};kv={r.kv_heads.start}-{r.kv_heads.stop}" for r in ranks)


def parse_layout(kv_endpoint: str, num_kv_heads: int) -> list[RankKV]:
    """The ranks named by ``kv_endpoint`` (a plain endpoint: one rank holding all heads).
    Raises ValueError for a malformed string or heads outside [0, num_kv_heads)."""
    ranks = []
    for item in kv_endpoint.split(","):
        endpoint, _, heads = item.partition(";kv=")
        if not endpoint.startswith("tcp://"):
            raise ValueError(f"KV endpoint {endpoint!r} is not tcp://host:port")
        if not heads:
            ranks.append(RankKV(endpoint, range(num_kv_heads)))
            continue
        start, _, stop = heads.partition("-")
        if not (start.isdigit() and stop.isdigit()) or not 0 <= int(start) < int(stop) <= num_kv_heads:
            raise ValueError(f"KV heads {heads!r} of {endpoint} are not a range within [0, {num_kv_heads})")
        ranks.append(RankKV(endpoint, range(int(start), int(stop))))
    return ranks


def is_single_rank(kv_endpoint: str) -> bool:
    return "," not in kv_endpoint and ";kv=" not in kv_endpoint


@dataclass(frozen=True)
class PullSource:
    """One piece of a gen rank's pull: KV heads ``ctx_heads`` (the ctx rank's own indices) from
    ``endpoint`` go to this rank's heads ``local_heads``."""

    endpoint: str
    ctx_heads: range
    local_heads: range


def plan_pulls(ctx_ranks: list[RankKV], wanted: range) -> list[PullSource]:
    """The pieces that bring the model's KV heads ``wanted`` (a gen rank's) from ``ctx_ranks``:
    each head from the first ctx rank that holds it (replicated heads are pulled once).
    Raises ValueError when a head is held by none."""
    sources: list[PullSource] = []
    head = wanted.start
    while head < wanted.stop:
        holder = next((r for r in ctx_ranks if head in r.kv_heads), None)
        if holder is None:
            raise ValueError(f"no ctx rank holds KV head {head}")
        stop = min(wanted.stop, holder.kv_heads.stop)
        sources.append(PullSource(holder.endpoint, range(head - holder.kv_heads.start, stop - holder.kv_heads.start),
                                  range(head - wanted.start, stop - wanted.start)))
        head = stop
    return sources
