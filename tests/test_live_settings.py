"""What a reload sees as changed, and the supervisor's control channel, without a deployment."""

from __future__ import annotations

import threading

import msgspec

from disagg.deploy_config import load_deploy_config
from disagg.live_settings import changed_keys, is_live
from disagg.supervisor_control import (
    AddWorkers,
    ControlAnswer,
    RetireWorkers,
    answer_request,
    ask_supervisor,
    take_requests,
)


def _config(tmp_path, text: str):
    path = tmp_path / "d.yaml"
    path.write_text(text)
    return load_deploy_config(path)


def test_changed_keys_split_into_live_ones_and_ones_that_need_a_restart(tmp_path):
    old = _config(tmp_path, "model: tiny\n")
    new = _config(tmp_path, "model: tiny\norchestrator: {gen_router: {policy: session}, timeouts: {idle_seconds: 5},"
                            " log_level: debug}\nengine: {max_num_seqs: 8}\npools: {gen: {instances: 2}}\n")
    changes = changed_keys(old, new)
    assert changes == {"engine.max_num_seqs": (None, 8), "orchestrator.gen_router.policy": ("round_robin", "session"),
                       "orchestrator.log_level": ("info", "debug"), "orchestrator.timeouts.idle_seconds": (120.0, 5.0),
                       "pools.gen.instances": (1, 2)}
    assert [key for key in changes if is_live(key)] == [
        "orchestrator.gen_router.policy", "orchestrator.log_level", "orchestrator.timeouts.idle_seconds"]
    assert changed_keys(old, _config(tmp_path, "model: tiny\n")) == {}


def test_a_request_is_answered_through_the_run_dir_and_a_malformed_one_refused(tmp_path):
    def supervisor() -> None:  # one round of what disagg.supervisor does
        while True:
            for ident, request in take_requests(tmp_path):
                assert isinstance(request, AddWorkers)
                answer_request(tmp_path, ident, ControlAnswer(ok=True, message=f"started {request.count}",
                                                              started={"gen-1": "http://h:1"}))
                return

    thread = threading.Thread(target=supervisor)
    thread.start()
    answer = ask_supervisor(tmp_path, AddWorkers(pool="gen", count=1), timeout=10)
    thread.join()
    assert answer.ok and answer.started == {"gen-1": "http://h:1"}
    (tmp_path / "control" / "x.request.json").write_bytes(msgspec.json.encode({"type": "explode"}))
    ((ident, refused),) = take_requests(tmp_path)
    assert ident == "x" and isinstance(refused, str) and "malformed request" in refused
    assert take_requests(tmp_path) == []  # taken once


def test_an_unanswered_request_is_taken_back(tmp_path):
    try:
        ask_supervisor(tmp_path, RetireWorkers(names=["gen-0"]), timeout=0.2)
    except RuntimeError as exc:
        assert "did not answer" in str(exc)
    else:
        raise AssertionError("no supervisor answered, yet the request returned")
    assert list((tmp_path / "control").iterdir()) == []  # nobody acts on it later by surprise
