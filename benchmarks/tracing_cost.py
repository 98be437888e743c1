"""What tracing costs the orchestrator per request, in one process: CPU-seconds (process_time).

The orchestrator's share of one disaggregated request's tracing, as its code
runs it (``orchestrator.request_end.RequestEnds``): the root span under a
client's ``traceparent``, a ``ctx_leg`` span closed and a ``gen_leg`` span
kept open (each with its outgoing ``traceparent``), then the request's end
(``orchestrator.prepare``, the attributes, the usage read from the answer).
Three settings: tracing off (the default: what every request pays), on with
every request sampled, and on with ``sample_ratio: 0`` for requests whose
client sent no ``traceparent``. The exporter points at a closed port: spans
are queued and dropped by the SDK's batch thread, whose export work is not in
the request's path.

    python benchmarks/tracing_cost.py [--requests 5000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.tracing import Tracing
from orchestrator.request_end import RequestEnds
from orchestrator.state_protocol import RequestTrace

CLIENT_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
ANSWER = b'{"id": "x", "usage": {"prompt_tokens": 24, "completion_tokens": 16}}'


class _Link:
    perf_queue: deque = deque(maxlen=1024)


def one_request(ends: RequestEnds, traceparent: str | None) -> None:
    now = time.time()
    record = RequestTrace(request_id="req-1", api="chat", arrival=now, tokenized=now)
    ends.begin(record, traceparent)
    ctx_headers = {"x-request-id": "req-1-ctx"}
    span = ends.open_leg(record, "ctx", "ctx-0", now, ctx_headers)
    if span is not None:
        ends.close_leg(span, time.time())
    span = ends.open_leg(record, "gen", "gen-0", now, {"x-request-id": "req-1-gen"})
    if span is not None:
        ends.keep_gen_leg(record, span)
    record.end = time.time()
    ends.end(record, 200, ANSWER)


def measure(ends: RequestEnds, traceparent: str | None, requests: int, rounds: int) -> float:
    """The best round's CPU microseconds per request."""
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(requests):
            one_request(ends, traceparent)
        best = min(best, (time.process_time() - start) / requests * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)  # the SDK's "queue full" and export-failure lines
    endpoint = "http://127.0.0.1:9"  # the discard port, closed: nothing is sent anywhere
    settings = [
        ("off (default)", RequestEnds(_Link(), False, None), CLIENT_TRACEPARENT),
        ("on, sampled", RequestEnds(_Link(), False, Tracing(endpoint, "bench")), CLIENT_TRACEPARENT),
        ("on, sample_ratio 0", RequestEnds(_Link(), False, Tracing(endpoint, "bench", sample_ratio=0.0)), None),
    ]
    for name, ends, traceparent in settings:
        print(f"tracing {name:<20} {measure(ends, traceparent, args.requests, args.rounds):8.1f} us CPU per request")


if __name__ == "__main__":
    main()
