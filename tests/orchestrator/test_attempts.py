"""One phase's attempts (orchestrator.attempts): when every worker tried said it cannot serve now
(503: a stalled or dead engine; 429: busy), the client's answer is a retryable 503, not a 502."""

from __future__ import annotations

from orchestrator.attempts import SAME_WORKER_RETRIES, Attempts
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


def test_a_lost_connection_is_the_same_worker_a_bounded_number_of_times_then_a_suspect():
    """One of a worker's K frontends dying is not the worker: the transport raised, this decides."""
    attempts = Attempts("gen", max_retries=0)
    w = worker("w0")
    attempts.start(w)
    lost = LegFailed("closed the connection", unanswered=True, connection_lost=True)
    pauses = []
    for _ in range(SAME_WORKER_RETRIES):
        assert attempts.failed(w, lost) == (False, True)  # not suspected, again
        pauses.append(attempts.pause(w))
    assert pauses == sorted(pauses) and pauses[0] > 0  # each try waits longer for the dead socket to go
    assert attempts.failed(w, lost) == (True, False)  # then the worker is the suspect
    assert Attempts("gen", max_retries=0).failed(w, LegFailed("timeout", unanswered=True)) == (True, False)
