"""Losing one frontend process of a worker is not losing the worker (issue 16, item 10).

A connection to the killed frontend fails; the orchestrator's leg client tries
once more on a fresh connection, which the kernel (SO_REUSEPORT) hands to the
worker's surviving frontend, so the worker is never suspected and clients never
see ``503 no healthy generation worker``.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
from orchestrator_process import start_orchestrator, stop_orchestrator
from worker_process import start_worker, stop_worker

from tests.worker_procs import frontend_slots, wait_until


def test_sigkill_of_one_attached_frontend_gives_clients_no_503(tiny_model_dir, tmp_path):
    worker_url, worker = start_worker(tiny_model_dir, 2, extra_args=["--synthetic-decode-step-seconds", "0.01"])
    url, orchestrator = start_orchestrator(tmp_path, tiny_model_dir, [("both", worker_url)], processes=1)
    statuses: list[int] = []
    stop = threading.Event()

    def client(number: int) -> None:
        with httpx.Client(timeout=30) as http:  # keep-alive to the orchestrator, as SDKs do
            while not stop.is_set():
                body = {"model": "tiny-test", "prompt": "hello", "max_tokens": 4, "stream": number % 2 == 1}
                statuses.append(http.post(f"{url}/v1/completions", json=body).status_code)

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        wait_until(lambda: len(statuses) >= 20, 30)
        pid = frontend_slots(worker.pid)[1]
        os.kill(pid, signal.SIGKILL)
        seen = len(statuses)
        time.sleep(2.5)  # the old suspect window was 2 s
        stop.set()
        for thread in threads:
            thread.join(30)
        after = statuses[seen:]
        assert len(after) > 10  # the load went on through the kill
        assert [s for s in statuses if s != 200] == []
    finally:
        stop.set()
        assert stop_orchestrator(orchestrator) == 0
        stop_worker(worker)
