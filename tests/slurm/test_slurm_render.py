from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_plans import dsv4_plan, local_plan, narrow_plan

from disagg.deploy_config import load_deploy_config
from disagg.slurm_deployment import build_slurm_plan
from slurm.config import ContainerConfig, SlurmConfig
from slurm.plan import RUN_DIR, JobPlan, Step
from slurm.render import render_script
from workers.config import ConfigError

SNAPSHOTS = Path(__file__).parent / "snapshots"
REPO = Path(__file__).resolve().parents[2]
UPDATE = os.environ.get("DISAGG_UPDATE_SNAPSHOTS") == "1"  # rewrite the snapshots, then read the diff


def _check_snapshot(name: str, script: str) -> None:
    path = SNAPSHOTS / name
    if UPDATE:
        path.write_text(script)
    assert script == path.read_text(), f"{path} differs; DISAGG_UPDATE_SNAPSHOTS=1 rewrites it"


def _srun_steps(script: str) -> list[str]:
    """Each srun command with its continuation lines joined."""
    return [m.replace("\\\n    ", "") for m in re.findall(r"^srun (?:.*\\\n)*.*&$", script, flags=re.M)]


def _yaml_script(name: str) -> str:
    """What `disagg render configs/<name>` prints, run from the repository root."""
    return render_script(build_slurm_plan(load_deploy_config(REPO / "configs" / name), f"configs/{name}"))


@pytest.mark.parametrize("name", ["local", "dsv4", "dsv4-synthetic"])
def test_yaml_snapshot(name: str) -> None:
    _check_snapshot(f"{name}.sbatch", _yaml_script(f"{name}.yaml"))


def test_dsv4_synthetic_yaml_script_runs_twelve_workers_that_register_through_the_run_dir() -> None:
    script = _yaml_script("dsv4-synthetic.yaml")
    steps = _srun_steps(script)
    assert len(steps) == 13 and sum("--mpi=pmix" in s for s in steps) == 12
    assert "python -m disagg.orchestrator_plan configs/dsv4-synthetic.yaml --run-dir \"$RUN_DIR\"\n" in script
    for step in steps[1:]:
        assert ' python -m slurm.step worker --run-dir "$RUN_DIR" -- python -m disagg.cli serve ' in step
        assert ' --host 0.0.0.0 ' in step and ' --cluster-key-file "$RUN_DIR"/cluster.key ' in step
        assert ' --engine synthetic ' in step and ' --synthetic-decode-step-seconds 0.01 ' in step
    assert [re.search(r"--state-dir \"\$RUN_DIR\"/state/(\S+)", s).group(1) for s in steps[1:]] == [
        *(f"ctx-{i}" for i in range(11)), "gen-0"]


@pytest.mark.parametrize("plan", [local_plan(), dsv4_plan()], ids=["local", "dsv4"])
def test_scripts_are_valid_bash(plan: JobPlan, tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(render_script(plan))
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_dsv4_runs_all_twelve_workers_pinned_to_their_nodes() -> None:
    script = render_script(dsv4_plan())
    steps = _srun_steps(script)
    assert len(steps) == 13  # orchestrator + 11 ctx + 1 gen
    assert "--nodes=1 --ntasks=1 --ntasks-per-node=1" in steps[0] and '-w "${NODES[0]}"' in steps[0]
    for i, step in enumerate(steps[1:12]):
        assert f'-w "${{NODES[{i}]}}"' in step and f"--port {8100 + i} --num-frontends 8" in step
        assert "--nodes=1 --ntasks=4 --ntasks-per-node=4 --cpus-per-task=\"$((CPUS / 4))\"" in step
        assert "--mpi=pmix" in step and "--gres=gpu:4 -w" in step
    gen = steps[12]
    assert "--nodes=4 --ntasks=16 --ntasks-per-node=4" in gen and "--mpi=pmix" in gen
    assert '-w "${NODES[11]},${NODES[12]},${NODES[13]},${NODES[14]}"' in gen
    assert "--port 8200 --num-frontends 4" in gen
    assert all("--container-image='nvcr.io#nvidia/pytorch:24.05-py3' "
               "--container-mounts=/shared:/shared,/models:/models:ro" in s for s in steps)
    assert "#SBATCH --nodes=15\n" in script and "#SBATCH --gpus-per-node=4\n" in script
    assert script.rstrip().endswith("wait")


def _in_container(container: ContainerConfig) -> JobPlan:
    plan = dsv4_plan()
    setup = (("python", "-m", "disagg.orchestrator_plan", "/shared/dsv4.yaml", "--run-dir", RUN_DIR),)
    return dataclasses.replace(plan, slurm=dataclasses.replace(plan.slurm, container=container), setup=setup)


def test_pyxis_runs_the_setup_in_the_image_too(tmp_path: Path) -> None:
    """The batch shell is on the host: its setup line goes through a one-task srun with the image."""
    script = render_script(_in_container(ContainerConfig("/shared/disagg-cpu.sqsh", ("/shared:/shared",))))
    assert "# ---- setup, once, in the container before any step ----\n" \
           'srun --overlap --nodes=1 --ntasks=1 -w "${NODES[0]}" --container-image=/shared/disagg-cpu.sqsh ' \
           '--container-mounts=/shared:/shared python -m disagg.orchestrator_plan /shared/dsv4.yaml ' \
           '--run-dir "$RUN_DIR"\n' in script
    steps = _srun_steps(script)
    assert "--container-mounts=/shared:/shared disagg orchestrator " in steps[0]
    assert all("--gres=gpu:4 -w " in step and
               "--container-image=/shared/disagg-cpu.sqsh --container-mounts=/shared:/shared disagg serve " in step
               for step in steps[1:])


def test_apptainer_wraps_the_setup_and_every_step_command(tmp_path: Path) -> None:
    container = ContainerConfig("/shared/disagg-cpu.sif", ("/shared:/shared", "/models:/models:ro"), "apptainer")
    script = render_script(_in_container(container))
    wrap = "apptainer exec --nv --bind=/shared:/shared,/models:/models:ro /shared/disagg-cpu.sif"
    assert f'\n{wrap} python -m disagg.orchestrator_plan /shared/dsv4.yaml --run-dir "$RUN_DIR"\n' in script
    steps = _srun_steps(script)
    assert steps[0].count(wrap) == 1 and f"{wrap} disagg orchestrator " in steps[0]
    # srun (with its GPU request) starts apptainer on each rank's node; the command runs inside
    assert all("--gres=gpu:4 -w " in step and f'.log" {wrap} disagg serve ' in step for step in steps[1:])
    assert "--container-image" not in script
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True).returncode == 0


def test_local_has_no_mpi_and_one_cpu_node() -> None:
    script = render_script(local_plan())
    steps = _srun_steps(script)
    assert len(steps) == 3 and not any("--mpi" in s for s in steps)
    assert "#SBATCH --cpus-per-task=8\n" in script and "--gpus-per-node" not in script
    assert 'RUN_DIR="${DISAGG_RUN_DIR:-$SLURM_SUBMIT_DIR/disagg-runs/$SLURM_JOB_NAME-$SLURM_JOB_ID}"' in script


def test_run_dir_placeholder_and_quoting() -> None:
    plan = local_plan(orchestrator_argv=["echo", "a b", "{run_dir}/x y", "it's"])
    step = _srun_steps(render_script(plan))[0]
    assert step.endswith("""echo 'a b' "$RUN_DIR"'/x y' 'it'"'"'s' &""")


def test_plan_rejects_bad_steps() -> None:
    slurm = SlurmConfig(nodes=2)
    with pytest.raises(ConfigError, match="step names must be unique"):
        JobPlan(slurm, (Step("a", ("x",), (0,)), Step("a", ("x",), (1,))), "t")
    with pytest.raises(ConfigError, match=r"steps\.a: nodes \[2\] outside the job's 2 nodes"):
        JobPlan(slurm, (Step("a", ("x",), (2,)),), "t")
    with pytest.raises(ConfigError, match="empty command"):
        JobPlan(slurm, (Step("a", (), (0,)),), "t")


def test_pool_engine_settings_reach_that_pool_only(tmp_path: Path) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text("model: tiny\nlauncher: slurm\nengine: {dtype: float32}\n"
                    "pools: {ctx: {base_port: 9100}, gen: {base_port: 9200, engine: {decode_attention: sdpa}}}\n")
    steps = _srun_steps(render_script(build_slurm_plan(load_deploy_config(path), str(path))))
    ctx_steps = [s for s in steps if "/state/ctx-" in s]
    gen_steps = [s for s in steps if "/state/gen-" in s]
    assert ctx_steps and gen_steps
    assert all(" --dtype float32 " in s for s in ctx_steps + gen_steps)
    assert all(" --decode-attention sdpa " in s for s in gen_steps)
    assert not any("--decode-attention" in s for s in ctx_steps)


@pytest.mark.parametrize("yaml, flag, value", [("tool_call_parser: hermes", "--tool-call-parser", "hermes"),
                                               ("engine: {kv_pull_timeout: 4.5}", "--kv-pull-timeout", "4.5")])
def test_a_deployment_key_reaches_every_worker_on_both_launchers(tmp_path: Path, yaml: str, flag: str,
                                                                 value: str) -> None:
    from disagg.cli import build_parser
    from disagg.deploy_plan import local_plan as local_deploy_plan

    path = tmp_path / "d.yaml"
    path.write_text(f"model: tiny\nlauncher: slurm\n{yaml}\npools: {{ctx: {{base_port: 9100}}, gen: {{base_port: 9200}}}}\n")
    config = load_deploy_config(path)
    steps = [s for s in _srun_steps(render_script(build_slurm_plan(config, str(path)))) if " serve " in s]
    assert len(steps) == 2 and all(f" {flag} {value} " in s for s in steps)
    for worker in local_deploy_plan(config, tmp_path, tmp_path / "model").workers:
        assert worker.argv[worker.argv.index(flag) + 1] == value
        parsed = build_parser().parse_args(worker.argv[3:])  # serve accepts what the YAML renders
        assert str(getattr(parsed, flag[2:].replace("-", "_"))) == value


def test_each_worker_step_asks_slurm_for_its_gpus_and_none_sets_cuda_visible_devices() -> None:
    for plan in (dsv4_plan(), narrow_plan()):
        script = render_script(plan)
        assert "CUDA_VISIBLE_DEVICES" not in script
        for step in _srun_steps(script)[1:]:
            assert re.search(r" --gres=gpu:[1-4] ", step), step
        assert "--gres" not in _srun_steps(script)[0]  # the orchestrator needs none
    steps = {s.split("--job-name=")[1].split()[0]: s for s in _srun_steps(render_script(narrow_plan()))}
    # The node's first GPUs: asked for by count, every task sees them all.
    assert " --gres=gpu:2 -w " in steps["ctx-0"] and "--gpu-bind" not in steps["ctx-0"]
    # Sharing the node: overlapping steps share GRES, so each TP rank is bound to its own GPU.
    assert " --gres=gpu:4 --gpu-bind=map_gpu:2,3 " in steps["ctx-1"]
    # One task: Slurm does not bind it; slurm.step applies the same mask.
    assert " --gres=gpu:1 -w " in steps["gen-0"] and "--gpu-bind" not in steps["gen-0"]
    assert " --gres=gpu:2 --gpu-bind=mask_gpu:0x2 " in steps["gen-1"] and " env DISAGG_GPU_MASK=0x2 " in steps["gen-1"]


def test_render_names_the_config_by_its_absolute_path(tmp_path: Path) -> None:
    config = tmp_path / "dsv4.yaml"
    config.write_text((REPO / "configs" / "dsv4.yaml").read_text())
    result = subprocess.run([sys.executable, "-m", "disagg.cli", "render", "dsv4.yaml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"python -m disagg.orchestrator_plan {config} --run-dir" in result.stdout
