"""The frontend watchdog's fatal path, with fake probes and a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from frontends.watchdog import Probe, Watchdog, frontend_probes


class FakeEngine:
    """Stands in for the engine client: healthy until told otherwise."""

    def __init__(self) -> None:
        self.dead_reason: str | None = None


class Recorder:
    def __init__(self) -> None:
        self.fatal: list[str] = []
        self.shutting_down = False

    def on_fatal(self, reason: str) -> None:
        self.fatal.append(reason)


def make_watchdog(engine: FakeEngine, recorder: Recorder, limit: int = 1, clock=lambda: 100.0) -> Watchdog:
    probe = Probe("engine", lambda: engine.dead_reason, limit=limit)
    return Watchdog([probe], recorder.on_fatal, lambda: recorder.shutting_down, clock=clock)


def test_a_dead_engine_is_fatal_once():
    engine, recorder = FakeEngine(), Recorder()
    watchdog = make_watchdog(engine, recorder)
    assert watchdog.check() is None
    engine.dead_reason = "no heartbeat for 3.2 s"
    assert watchdog.check() == "engine: no heartbeat for 3.2 s"
    for _ in range(5):
        assert watchdog.check() is None
    assert recorder.fatal == ["engine: no heartbeat for 3.2 s"]
    assert watchdog.fatal_reason == "engine: no heartbeat for 3.2 s"
    assert watchdog.fatal_at == 100.0


def test_nothing_is_raised_when_a_shutdown_is_under_way():
    engine, recorder = FakeEngine(), Recorder()
    watchdog = make_watchdog(engine, recorder)
    recorder.shutting_down = True
    engine.dead_reason = "the engine client was closed"
    for _ in range(3):
        assert watchdog.check() is None
    assert recorder.fatal == []
    assert watchdog.fatal_reason is None


def test_the_limit_counts_consecutive_failures_only():
    engine, recorder = FakeEngine(), Recorder()
    watchdog = make_watchdog(engine, recorder, limit=3)
    for reason in ("slow", "slow", None, "slow", "slow"):
        engine.dead_reason = reason
        assert watchdog.check() is None
    engine.dead_reason = "slow"
    assert watchdog.check() == "engine: slow"
    assert recorder.fatal == ["engine: slow"]


def test_frontend_probes_watch_the_launcher_first():
    engine, recorder = FakeEngine(), Recorder()
    alive = {41: True}
    probes = frontend_probes(engine, 41, lambda pid: alive[pid])
    assert [p.name for p in probes] == ["launcher", "engine"]
    assert [p.name for p in frontend_probes(engine, None, lambda pid: True)] == ["engine"]
    watchdog = Watchdog(probes, recorder.on_fatal, lambda: False)
    assert watchdog.check() is None
    alive[41] = False
    engine.dead_reason = "the engine process (pid 42) exited"
    assert watchdog.check() == "launcher: pid 41 is gone"
    assert watchdog.check() is None
    assert recorder.fatal == ["launcher: pid 41 is gone"]


@pytest.mark.asyncio
async def test_run_stops_after_the_fatal_round():
    engine, recorder = FakeEngine(), Recorder()
    watchdog = Watchdog([Probe("engine", lambda: engine.dead_reason)], recorder.on_fatal, lambda: False,
                        interval=0.01)
    task = asyncio.create_task(watchdog.run())
    await asyncio.sleep(0.05)
    assert not task.done()
    engine.dead_reason = "gone"
    await asyncio.wait_for(task, 2)
    assert recorder.fatal == ["engine: gone"]
