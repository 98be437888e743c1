"""A worker's access log (``--access-log``): one INFO line per request from each of its frontends,
and no traceback for a client's error."""

from __future__ import annotations

import time

import httpx

from tests.worker_process import start_worker, stop_worker, worker_log


def test_a_worker_logs_one_line_per_request_and_no_traceback_for_client_errors(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, 2, extra_args=["--access-log", "--log-level", "info"])
    try:
        for i in range(6):  # fresh connections: both frontends answer some
            assert httpx.get(f"{url}/v1/models/probe-{i}").status_code == 404
        assert httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "x",
                                                         "max_tokens": -1}).status_code == 400
        assert httpx.post(f"{url}/v1/completions", content=b"{not json").status_code == 400
        assert httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "x",
                                                         "max_tokens": 2}).status_code == 200
        time.sleep(0.3)
        lines = worker_log(proc).splitlines()
        for i in range(6):
            assert sum(f"/v1/models/probe-{i} " in line for line in lines) == 1, lines[-20:]
        assert sum('"POST /v1/completions HTTP/1.1" 400' in line for line in lines) == 2
        assert sum('"POST /v1/completions HTTP/1.1" 200' in line for line in lines) == 1
        assert not any("Traceback" in line for line in lines)
    finally:
        stop_worker(proc)


def test_the_access_log_is_off_by_default(tiny_model_dir):
    url, proc = start_worker(tiny_model_dir, 1, extra_args=["--log-level", "info"])
    try:
        assert httpx.get(f"{url}/v1/models/probe").status_code == 404
        time.sleep(0.2)
        assert "/v1/models/probe" not in worker_log(proc)
    finally:
        stop_worker(proc)
