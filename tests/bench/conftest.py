"""The server ``disagg bench`` tests run against: a real worker on the synthetic engine, free port."""

from __future__ import annotations

import pytest

from tests.worker_process import start_worker, stop_worker


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, num_frontends=1,
                             extra_args=["--synthetic-decode-step-seconds", "0.002", "--max-model-len", "8192"])
    yield url
    assert stop_worker(proc) == 0
