"""common.log_format: text and JSON lines, the request id from the task's context, polls out of the access log."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import subprocess
import sys

import pytest

from common.log_format import (
    POLL_LOGGER,
    REQUEST_ID,
    JsonFormatter,
    PollFilter,
    RequestIdFilter,
    TextFormatter,
    stdout_line,
)


def _logger(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    handler.addFilter(RequestIdFilter())
    logger = logging.getLogger(f"test.log_format.{id(out)}")
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.DEBUG)
    return logger, out


def test_json_lines_carry_the_request_of_the_task_that_wrote_them():
    logger, out = _logger(JsonFormatter("orchestrator"))

    async def request(request_id: str) -> None:
        REQUEST_ID.set(request_id)
        await asyncio.sleep(0)  # the other request's task runs in between
        logger.info("serving %s", "it")

    async def main() -> None:
        await asyncio.gather(request("a"), request("b"))
        logger.warning("between requests")

    asyncio.run(main())
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(e["msg"], e.get("request_id")) for e in lines] == [
        ("serving it", "a"), ("serving it", "b"), ("between requests", None)]
    assert lines[0]["process"] == "orchestrator" and lines[0]["level"] == "INFO" and lines[0]["ts"].endswith("Z")


def test_fields_and_tracebacks():
    logger, out = _logger(JsonFormatter("engine"))
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("failed", extra={"fields": {"status": 500}, "request_id": "r-1"})
    (entry,) = [json.loads(line) for line in out.getvalue().splitlines()]
    assert entry["status"] == 500 and entry["request_id"] == "r-1" and "ValueError: boom" in entry["exc"]

    logger, out = _logger(TextFormatter("%(levelname)s %(message)s"))
    REQUEST_ID.set("r-2")
    try:
        logger.info("done", extra={"fields": {"status": 200, "error": None}})
    finally:
        REQUEST_ID.set(None)
    assert out.getvalue() == "INFO done request=r-2 status=200 error=-\n"


def test_polls_leave_the_access_log_for_a_debug_logger():
    access, out = _logger(logging.Formatter("%(message)s"))
    access.addFilter(PollFilter())
    polls, poll_out = _logger(logging.Formatter("%(name)s %(message)s"))
    poll_logger = logging.getLogger(POLL_LOGGER)
    poll_logger.handlers, poll_logger.propagate = polls.handlers, False
    poll_logger.setLevel(logging.DEBUG)
    try:
        fmt = '%s - "%s %s HTTP/%s" %d'
        access.info(fmt, "127.0.0.1:1", "GET", "/health", "1.1", 200)
        access.info(fmt, "127.0.0.1:1", "GET", "/prometheus/metrics?x=1", "1.1", 200)
        access.info(fmt, "127.0.0.1:1", "POST", "/v1/chat/completions", "1.1", 200)
    finally:
        poll_logger.handlers, poll_logger.propagate = [], True
    assert out.getvalue().splitlines() == ['127.0.0.1:1 - "POST /v1/chat/completions HTTP/1.1" 200']
    assert poll_out.getvalue().count(POLL_LOGGER) == 2


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_the_ready_line_keeps_its_words(log_format):
    line = stdout_line("disagg serve: ready on http://127.0.0.1:1", log_format, "launcher")
    if log_format == "text":
        assert line == "disagg serve: ready on http://127.0.0.1:1"
    else:
        assert json.loads(line)["msg"] == "disagg serve: ready on http://127.0.0.1:1"


def test_the_engine_process_logs_json():
    """A process set up as the engine sets itself up (``--log-format json``): a line naming a request by its id."""
    proc = subprocess.run([sys.executable, "-c", "import logging; from common.log_format import configure_logging; "
                           "configure_logging('info', 'json', 'engine'); logging.getLogger('disagg.engine')"
                           ".warning('rejected request %d', 7, extra={'request_id': 'req-7-gen'})"],
                          capture_output=True, text=True, timeout=60)
    entry = json.loads(proc.stderr)
    assert entry["process"] == "engine" and entry["request_id"] == "req-7-gen" and entry["msg"] == "rejected request 7"


def test_with_json_an_uncaught_exception_and_a_warning_are_json_lines_too():
    code = ("import warnings; from common.log_format import configure_logging; "
            "configure_logging('info', 'json', 'launcher'); warnings.warn('careful'); raise RuntimeError('crash')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    entries = [json.loads(line) for line in proc.stderr.splitlines()]
    assert [e["logger"] for e in entries] == ["py.warnings", "disagg.uncaught"], proc.stderr
    assert "careful" in entries[0]["msg"] and "RuntimeError: crash" in entries[1]["exc"]
