"""The state owner's socket and the registration routes decode typed bodies: a malformed one is a 400
in the OpenAI shape naming the field, never a 500, and a well-formed one round-trips into the snapshot."""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import pytest
from orchestrator_process import start_orchestrator, stop_orchestrator

from orchestrator.state_protocol import LoadPush, PerfPush, RequestTrace, Snapshot


@pytest.fixture
def orchestrator(tmp_path, tiny_model_dir):
    url, proc = start_orchestrator(tmp_path, tiny_model_dir, workers=[], processes=1, wait_healthy=False)
    state_dir = next(Path(tmp_path).glob("orch-*"))
    state = httpx.Client(transport=httpx.HTTPTransport(uds=str(state_dir / "state.sock")), base_url="http://state")
    try:
        yield url, state
    finally:
        state.close()
        stop_orchestrator(proc)


def _refused(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


@pytest.mark.parametrize("path, body, param", [
    ("/load", {"process": "zero", "loads": {}}, "process"),
    ("/load", {"process": 0, "loads": {"w": [1, "x"]}}, "loads[...][1]"),
    ("/perf", {"records": [{"request_id": "r", "api": "chat"}]}, "records[0].arrival"),
    ("/perf", {"records": [{"request_id": "r", "api": "chat", "arrival": 1.0, "ctx": {"worker_id": "w"}}]},
     "records[0].ctx.start"),
    ("/perf", {"records": [{"request_id": "r", "api": "chat", "arrival": 1.0,
                            "gen": {"worker_id": "w", "start": 1.0, "first_byte": "soon"}}]}, "records[0].gen.first_byte"),
    ("/perf", {"records": [{"request_id": "r", "api": "chat", "arrival": 1.0, "legs": [{"phase": "gen"}]}]},
     "records[0].legs[0].worker_id"),
    ("/register", {"role": "gen", "url": 5}, "url"),
    ("/heartbeat", {"worker": "w"}, "worker_id"),
    ("/drain", {"worker": "w"}, "draining"),
    ("/drain", {"worker": "nobody", "draining": True}, "worker"),
])
def test_a_malformed_state_body_is_a_400_naming_the_field(orchestrator, path, body, param):
    _, state = orchestrator
    _refused(state.post(path, content=msgspec.json.encode(body)), param)


def test_a_malformed_snapshot_query_is_a_400_naming_it(orchestrator):
    _, state = orchestrator
    _refused(state.get("/snapshot?after=soon"), "after")
    _refused(state.get("/snapshot?after=1&kv_after=x"), "kv_after")


def test_a_malformed_registration_through_the_public_port_is_a_400(orchestrator):
    url, _ = orchestrator
    _refused(httpx.post(f"{url}/workers/register", json={"role": "gen"}), "url")
    _refused(httpx.post(f"{url}/workers/heartbeat", json={"worker_id": 7}), "worker_id")
    response = httpx.post(f"{url}/workers/register", content=b"{not json")
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_typed_pushes_reach_the_snapshot(orchestrator):
    url, state = orchestrator
    ack = httpx.post(f"{url}/workers/register", json={"role": "gen", "url": "http://127.0.0.1:1"}).json()
    assert state.post("/load", content=msgspec.json.encode(LoadPush(3, {ack["worker_id"]: [2, 40]}))).json() == {
        "ok": True}
    trace = RequestTrace(request_id="r-1", api="chat", arrival=1.0)
    assert state.post("/perf", content=msgspec.json.encode(PerfPush([trace]))).status_code == 200
    snapshot = msgspec.json.decode(state.get("/snapshot").content, type=Snapshot)
    assert [w.worker_id for w in snapshot.workers] == [ack["worker_id"]]
    assert snapshot.loads == {"3": {ack["worker_id"]: [2, 40]}}


def test_a_drain_through_the_api_answers_once_every_process_holds_it(tmp_path, tiny_model_dir):
    url, proc = start_orchestrator(tmp_path, tiny_model_dir, workers=[("gen", "http://127.0.0.1:9")], processes=2,
                                   wait_healthy=False, api_key="sesame")
    try:
        auth = {"Authorization": "Bearer sesame"}
        assert httpx.post(f"{url}/workers/drain", json={"worker": "static-0"}).status_code == 401
        refused = httpx.post(f"{url}/workers/drain", json={"url": "x"}, headers=auth)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "worker", refused.text
        ack = httpx.post(f"{url}/workers/drain", json={"worker": "http://127.0.0.1:9"}, headers=auth).json()
        assert ack["worker"]["draining"] and ack["processes_confirmed"] == ack["processes"] == 2, ack
        for _ in range(6):  # whichever process answers already holds it
            workers = httpx.get(f"{url}/cluster_info", headers=auth).json()["workers"]
            assert [w["draining"] for w in workers] == [True]
        ack = httpx.post(f"{url}/workers/undrain", json={"worker": "static-0"}, headers=auth).json()
        assert not ack["worker"]["draining"] and ack["processes_confirmed"] == 2
    finally:
        stop_orchestrator(proc)
