"""disagg.run_state: the typed record a deployment leaves in its run directory, for either launcher."""

from __future__ import annotations

import json

from disagg.run_state import (
    LocalRunState,
    ProcessRecord,
    SlurmRunState,
    SlurmStep,
    clean,
    find_state,
    read_state,
    write_state,
)


def _local() -> LocalRunState:
    return LocalRunState(config="d.yaml", url="http://127.0.0.1:8000", supervisor_pid=10, supervisor_start_time=5,
                         processes=[ProcessRecord(name="ctx-0", url="http://127.0.0.1:8100", argv=["serve"], pid=11,
                                                  start_time=6, log="logs/ctx-0.log")])


def test_each_launcher_reads_back_what_it_wrote_and_only_its_own(tmp_path):
    local, slurm = tmp_path / "local", tmp_path / "slurm"
    local.mkdir(), slurm.mkdir()
    write_state(local, _local())
    job = SlurmRunState(job_id=42, config="d.yaml", job_name="disagg", orchestrator_port=8000,
                        steps=[SlurmStep(name="orchestrator", port=8000), SlurmStep(name="gen-0", port=8200, ranks=2)])
    write_state(slurm, job)
    assert sorted(p.name for p in local.iterdir()) == ["state.json"]  # no temporary file left behind
    assert read_state(local, LocalRunState) == find_state(local) == _local()
    assert read_state(slurm, SlurmRunState) == find_state(slurm) == job
    assert read_state(local, SlurmRunState) is None and read_state(slurm, LocalRunState) is None
    assert json.loads((local / "state.json").read_text())["supervisor_pid"] == 10  # what scripts and tests read


def test_an_older_state_still_names_its_processes_and_a_torn_one_reads_as_none(tmp_path):
    # Written before start times and argv were recorded: `down` must still find the pids.
    (tmp_path / "state.json").write_text(json.dumps({"supervisor_pid": 10, "processes": [{"name": "gen-0", "pid": 11}]}))
    state = read_state(tmp_path, LocalRunState)
    assert state is not None and [(p.name, p.pid, p.start_time) for p in state.processes] == [("gen-0", 11, None)]
    assert state.orchestrator_stop_seconds == 55.0
    (tmp_path / "state.json").write_text('{"supervisor_pid": 1')
    assert read_state(tmp_path, LocalRunState) is None
    (tmp_path / "state.json").write_text('{"supervisor_pid": "one"}')
    assert find_state(tmp_path) is None


def test_clean_removes_each_launchers_runtime_files_and_keeps_logs(tmp_path):
    for name in ("state.json", "cluster.key", "orchestrator.json", "prometheus.yml", "up.log", "logs/ctx-0.log",
                 "orchestrator/x", "prometheus/targets/t.json", "worker-state/gen-0/batches"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    clean(tmp_path, LocalRunState)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "logs/ctx-0.log", "prometheus.yml", "up.log", "worker-state/gen-0/batches"]
    assert not (tmp_path / "prometheus").exists()  # emptied by the targets' removal
    for name in ("slurm.json", "orchestrator.url", "nodes", "submitit/j.out", "ranks/gen-0.json", "state/gen-0/b"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    clean(tmp_path, SlurmRunState)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "logs/ctx-0.log", "up.log", "worker-state/gen-0/batches"]
