from __future__ import annotations

import stat
import threading
import time
from pathlib import Path

import pytest

from slurm.rendezvous import (
    create_cluster_key,
    publish_orchestrator_url,
    read_nodes,
    read_orchestrator_url,
    wait_for_orchestrator_url,
)


def test_cluster_key_is_owner_only_and_never_overwritten(tmp_path: Path) -> None:
    path = create_cluster_key(tmp_path / "run")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = path.read_text()
    assert len(bytes.fromhex(key)) == 32
    with pytest.raises(FileExistsError):
        create_cluster_key(tmp_path / "run")
    assert path.read_text() == key


def test_orchestrator_url_appears_atomically(tmp_path: Path) -> None:
    assert read_orchestrator_url(tmp_path) is None
    publish_orchestrator_url(tmp_path, "http://node3:8000")
    assert read_orchestrator_url(tmp_path) == "http://node3:8000"
    publish_orchestrator_url(tmp_path, "http://node4:8000")
    assert read_orchestrator_url(tmp_path) == "http://node4:8000"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["orchestrator.url"]  # no temporary left


def test_wait_returns_once_published(tmp_path: Path) -> None:
    timer = threading.Timer(0.3, publish_orchestrator_url, (tmp_path, "http://n0:8000"))
    timer.start()
    start = time.monotonic()
    assert wait_for_orchestrator_url(tmp_path, timeout=10, still_waiting=lambda: True) == "http://n0:8000"
    assert 0.25 < time.monotonic() - start < 5
    timer.join()


def test_wait_stops_when_the_job_ended_or_times_out(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="the job is no longer running"):
        wait_for_orchestrator_url(tmp_path, timeout=10, still_waiting=lambda: False)
    with pytest.raises(TimeoutError, match=r"no .*orchestrator.url after 0 s"):
        wait_for_orchestrator_url(tmp_path, timeout=0.3, still_waiting=lambda: True)


def test_nodes(tmp_path: Path) -> None:
    assert read_nodes(tmp_path) == []
    (tmp_path / "nodes").write_text("gpu-001\ngpu-002\n")
    assert read_nodes(tmp_path) == ["gpu-001", "gpu-002"]
