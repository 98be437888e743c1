"""One phase's attempts (orchestrator.attempts): when every worker tried said it cannot serve now
(503: a stalled or dead engine; 429: busy), the client's answer is a retryable 503, not a 502."""

from __future__ import annotations

from orchestrator.attempts import Attempts
from orchestrator.errors import LegFailed
from orchestrator.registry import WorkerRecord


def worker(name: str) -> WorkerRecord:
    return WorkerRecord(worker_id=name, role="gen", url=f"http://127.0.0.1/{name}", static=True)


def run(*failures: LegFailed) -> Attempts:
    attempts = Attempts("gen", max_retries=5)
    for i, exc in enumerate(failures):
        attempts.start(worker(f"w{i}"))
        attempts.failed(worker(f"w{i}"), exc)
    return attempts


def test_every_worker_unavailable_or_busy_is_unavailable():
    assert run(LegFailed("503", unavailable=True), LegFailed("429", refused=True)).all_unavailable()
    assert not run(LegFailed("503", unavailable=True), LegFailed("429", refused=True)).all_refused()


def test_one_broken_leg_is_a_failure():
    assert not run(LegFailed("503", unavailable=True), LegFailed("gone", unanswered=True)).all_unavailable()
    assert not run(LegFailed("500")).all_unavailable()
