"""Submit a ``JobPlan``: the rendered script through ``sbatch``, or the same script through submitit.

Both run exactly the text ``disagg render`` prints, so what an operator reads
is what runs. Through submitit the script runs inside submitit's batch job
(``use_srun=False``: once, in the batch shell, not once per task) with the
same sbatch options (``render.sbatch_options``); submitit adds its own log
files and pickles the callable to a file in its folder (never to a socket).
Job state comes from ``slurm.jobs`` (scontrol), not from submitit, whose
state needs ``sacct``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from slurm.jobs import SlurmCommandError
from slurm.plan import JobPlan
from slurm.render import render_script, sbatch_options

__all__ = ["write_script", "submit_script", "submit_with_submitit"]

# submitit writes these itself (its log files, its checkpoint signal); ours replace the signal.
_SUBMITIT_OWNS = frozenset({"output", "error"})


def write_script(plan: JobPlan, directory: Path) -> Path:
    """``<directory>/<job name>.sbatch``, executable."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{plan.slurm.job_name}.sbatch"
    path.write_text(render_script(plan), encoding="utf-8")
    path.chmod(0o755)
    return path


def submit_script(script: Path, submit_dir: Path, env: Mapping[str, str] | None = None) -> int:
    """``sbatch`` from ``submit_dir`` (the job's $SLURM_SUBMIT_DIR); returns the job id. ``env`` is
    added to this environment, which the job inherits (sbatch's default --export=ALL): e.g.
    DISAGG_RUN_DIR for a run directory made before submitting."""
    result = subprocess.run(["sbatch", "--parsable", str(script.resolve())], cwd=submit_dir,
                            env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise SlurmCommandError(f"sbatch {script}: {result.stderr.strip()}")
    return int(result.stdout.strip().split(";")[0])  # "<id>" or "<id>;<cluster>"


def submit_with_submitit(plan: JobPlan, folder: Path, submit_dir: Path, env: Mapping[str, str] | None = None) -> int:
    """The plan's script as a submitit job; submitit's files go to ``folder``. Returns the job id.
    ``env`` reaches the job through ``--export=ALL,KEY=VALUE,...`` (values without commas)."""
    import submitit  # optional: only this path needs it

    # submitit's sbatch runs from this process's working directory: anchor the run root instead.
    run_root = Path(plan.slurm.run_root)
    if not run_root.is_absolute():
        plan = dataclasses.replace(plan, slurm=dataclasses.replace(
            plan.slurm, run_root=str(submit_dir.resolve() / run_root)))
    script = write_script(plan, folder)
    options = {flag.replace("-", "_"): True if value is None else value
               for flag, value in sbatch_options(plan.slurm) if flag not in _SUBMITIT_OWNS}
    if env:
        if any("," in value for value in env.values()):
            raise ValueError(f"--export cannot carry a value with a comma: {dict(env)}")
        options["export"] = ",".join(["ALL", *(f"{key}={value}" for key, value in env.items())])
    executor = submitit.SlurmExecutor(folder=folder, python=sys.executable)
    # additional_parameters override submitit's defaults (time=5, nodes=1, signal=USR2@90).
    executor.update_parameters(use_srun=False, additional_parameters=options)
    job = executor.submit(submitit.helpers.CommandFunction(["bash", str(script)], cwd=str(submit_dir)))
    return int(job.job_id)
