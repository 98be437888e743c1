"""The orchestrator's process records (issue 27 item 3), with real processes: a recorded process still
running is swept (SIGTERM); one recorded with another start time (a recycled pid) is never signalled;
a torn record reads as none.
"""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest

from common.processes import pid_alive
from orchestrator.process_records import (
    KEEPER_FILE,
    PROCESSES_DIR,
    ProcessRecord,
    forget_records,
    keeper_alive,
    read_records,
    sweep,
    write_keeper,
    write_record,
)


def test_a_recorded_process_is_swept_and_a_recycled_pid_is_not(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_record(tmp_path, 0, child.pid)
        # Index 1 names the bystander's pid with another start time: a pid recycled since it was recorded.
        (tmp_path / PROCESSES_DIR / "1.json").write_bytes(msgspec.json.encode(ProcessRecord(bystander.pid, 1)))
        write_keeper(tmp_path, 1234)
        assert keeper_alive(tmp_path)  # this test's own process: not one to sweep
        (tmp_path / KEEPER_FILE).unlink()
        assert not keeper_alive(tmp_path)
        assert set(read_records(tmp_path)) == {0, 1}
        assert sweep(tmp_path, 10.0) == [child.pid]
        assert child.wait(10) is not None and not pid_alive(child.pid)
        assert bystander.poll() is None, "a recycled pid was signalled"
        forget_records(tmp_path)
        assert read_records(tmp_path) == {}
    finally:
        for proc in (child, bystander):
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("content", [b"", b"{", b'{"pid": "x"}'])
def test_a_torn_record_reads_as_none(tmp_path, content):
    (tmp_path / PROCESSES_DIR).mkdir()
    (tmp_path / PROCESSES_DIR / "0.json").write_bytes(content)
    assert read_records(tmp_path) == {}
    assert os.path.exists(tmp_path / PROCESSES_DIR / "0.json")
