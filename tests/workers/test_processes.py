"""common.processes: the one liveness check and the one SIGTERM -> grace -> SIGKILL, on real processes."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time

from common.process_identity import process_start_time, same_process
from common.processes import pid_alive, stop_process, stop_processes, terminate

# A child that ignores SIGTERM (only SIGKILL ends it) and says when it is ready to be signalled.
STUBBORN = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                  "print('ready', flush=True); time.sleep(60)"]


def _stubborn() -> subprocess.Popen:
    proc = subprocess.Popen(STUBBORN, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_pid_alive_counts_a_zombie_as_gone():
    proc = subprocess.Popen(["sleep", "60"])
    assert pid_alive(proc.pid)
    proc.kill()
    deadline = time.monotonic() + 5
    while pid_alive(proc.pid):  # exited but not reaped (a zombie) is already gone
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert proc.poll() is not None


def test_terminate_kills_only_what_outlives_the_grace():
    polite, stubborn = subprocess.Popen(["sleep", "60"]), _stubborn()
    try:
        begin = time.monotonic()
        killed = terminate([polite.pid, stubborn.pid], grace=1.0)
        took = time.monotonic() - begin
        assert killed == [stubborn.pid] and 1.0 <= took < 5.0
        assert polite.wait(5) == -signal.SIGTERM and stubborn.wait(5) == -signal.SIGKILL
    finally:
        for proc in (polite, stubborn):
            proc.kill()
            proc.wait()


def test_terminate_never_signals_a_process_that_is_not_the_recorded_one():
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        wrong = process_start_time(bystander.pid) - 1  # a recycled pid: same number, another process
        assert terminate([bystander.pid], 0.2, alive=lambda pid: same_process(pid, wrong)) == []
        time.sleep(0.1)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_terminate_without_a_signal_waits_then_kills():
    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert terminate([proc.pid], 0.3, sig=None) == [proc.pid]
        assert proc.wait(5) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()


def test_stop_process_sends_the_signal_asked_and_names_what_it_kills(caplog):
    assert stop_process(subprocess.Popen(["sleep", "60"]), 5, sig=signal.SIGINT) == -signal.SIGINT
    with caplog.at_level(logging.WARNING, logger="common.processes"):
        assert stop_process(_stubborn(), 0.5, name="the engine") == -signal.SIGKILL
    assert "the engine did not stop within 0 s: killing it" in caplog.text


def test_stop_processes_stops_them_in_parallel_and_reaps_them():
    procs = [_stubborn() for _ in range(3)]
    begin = time.monotonic()
    stop_processes(procs, 1.0)
    assert time.monotonic() - begin < 4.0  # one grace for all, not one each
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 3
