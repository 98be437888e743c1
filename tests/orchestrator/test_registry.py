"""The registry's TTL, health thresholds and rejoin rules, with a fake clock."""

from __future__ import annotations

import pytest

from orchestrator.config import HealthConfig
from orchestrator.registry import Registry, RegistryError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_registry(**health) -> tuple[Registry, Clock]:
    clock = Clock()
    return Registry(HealthConfig(**{"registration_ttl_seconds": 10.0, **health}), clock), clock


def test_registered_worker_expires_without_heartbeats_and_rejoins():
    registry, clock = make_registry()
    record = registry.register("gen", "http://10.0.0.1:8000/", "tcp://10.0.0.1:9000")
    assert record.url == "http://10.0.0.1:8000" and not record.healthy
    static = registry.add_static("ctx", "http://10.0.0.2:8000")
    clock.now += 8
    assert registry.heartbeat(record.worker_id)
    clock.now += 8  # 8 s since the heartbeat: still in
    assert registry.expire() == []
    clock.now += 2.5
    assert registry.expire() == [record.worker_id]
    assert not registry.heartbeat(record.worker_id)  # the worker learns it must register again
    clock.now += 1000
    assert registry.expire() == []  # static workers never expire
    again = registry.register("gen", "http://10.0.0.1:8000", "tcp://10.0.0.1:9000", worker_id=record.worker_id)
    assert again.worker_id == record.worker_id and not again.healthy
    assert [w.worker_id for w in registry.snapshot()] == sorted([static.worker_id, record.worker_id])


def test_same_url_keeps_its_id_and_a_changed_worker_gets_a_new_one():
    registry, _ = make_registry()
    first = registry.register("gen", "http://h:1")
    assert registry.register("gen", "http://h:1").worker_id == first.worker_id
    replaced = registry.register("ctx", "http://h:1")
    assert replaced.worker_id != first.worker_id and len(registry.workers) == 1


def test_health_thresholds_move_a_worker_out_and_back():
    registry, _ = make_registry(unhealthy_threshold=2, healthy_threshold=2)
    worker_id = registry.add_static("gen", "http://h:1").worker_id
    assert registry.report_check(worker_id, True) is False  # 1 of 2 successes
    assert registry.report_check(worker_id, True) is True and registry.workers[worker_id].healthy
    assert registry.report_check(worker_id, False, "boom") is False and registry.workers[worker_id].healthy
    assert registry.report_check(worker_id, True) is False  # a success resets the failure count
    assert registry.report_check(worker_id, False, "boom") is False
    assert registry.report_check(worker_id, False, "boom") is True
    assert not registry.workers[worker_id].healthy and registry.workers[worker_id].last_error == "boom"
    registry.report_check(worker_id, True)
    assert registry.report_check(worker_id, True) is True and registry.workers[worker_id].healthy


def test_deregister_and_bad_registrations():
    registry, _ = make_registry()
    worker_id = registry.register("both", "https://h:1").worker_id
    assert registry.deregister(worker_id) and not registry.deregister(worker_id)
    with pytest.raises(RegistryError, match="role"):
        registry.register("prefill", "http://h:1")
    with pytest.raises(RegistryError, match="url"):
        registry.register("gen", "h:1")


def test_registrations_past_the_bound_are_refused_until_one_expires():
    clock = Clock()
    registry = Registry(HealthConfig(registration_ttl_seconds=10.0), clock, max_workers=2)
    registry.register("gen", "http://10.0.0.1:8000")
    registry.register("ctx", "http://10.0.0.2:8000")
    with pytest.raises(RegistryError, match="the most it accepts"):
        registry.register("ctx", "http://10.0.0.3:8000")
    registry.register("ctx", "http://10.0.0.2:8000")  # a known worker re-registers freely
    clock.now += 11
    registry.expire()
    registry.register("ctx", "http://10.0.0.3:8000")


def test_a_drain_outlives_the_record_until_undrained_or_deregistered():
    registry, clock = make_registry()
    static = registry.add_static("ctx", "http://h:2")
    record = registry.register("gen", "http://h:1")
    before = registry.version
    assert registry.set_draining("http://h:1/", True) is record and record.draining
    assert registry.version > before  # published: every process must stop routing to it
    assert registry.set_draining(static.worker_id, True).draining  # by id too
    clock.now += 20
    assert registry.expire() == [record.worker_id]
    assert registry.register("gen", "http://h:1").draining  # it came back: still drained
    assert not registry.set_draining("http://h:1", False).draining
    assert not registry.register("gen", "http://h:1").draining
    registry.deregister(static.worker_id)
    assert not registry.register("ctx", "http://h:2").draining  # a new worker at a drained address
    with pytest.raises(RegistryError) as refused:
        registry.set_draining("http://nobody:1", True)
    assert refused.value.param == "worker"


def test_drains_outlive_a_restarted_state_owner(tmp_path):
    from orchestrator.config import OrchestratorConfig, StaticWorker
    from orchestrator.state import StateOwner

    config = OrchestratorConfig(model_dir="m", state_dir=str(tmp_path / "orch"),
                                workers=(StaticWorker("gen", "http://h:1"), StaticWorker("gen", "http://h:2")))
    owner = StateOwner(config)
    owner.registry.set_draining("http://h:2", True)
    owner.save_drains()
    again = StateOwner(config)  # what `disagg up` starts after orchestrator process 0 died
    assert {w.url: w.draining for w in again.registry.snapshot()} == {"http://h:1": False, "http://h:2": True}
