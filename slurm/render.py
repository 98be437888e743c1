"""A ``JobPlan`` as a standalone sbatch script an operator can read, edit and submit by hand.

The script: the ``#SBATCH`` header, the environment setup, a run directory on
the shared filesystem, then every step as a concurrent ``srun --overlap``
pinned to its node(s) by index into ``scontrol show hostnames``, then
``wait``. SIGTERM (scancel, preemption, 120 s before the time limit) reaches
every step's tasks, so that workers drain before Slurm kills them.
"""

from __future__ import annotations

import shlex
import textwrap

from slurm.config import ContainerConfig, SlurmConfig
from slurm.plan import RUN_DIR, JobPlan, Step
from slurm.rendezvous import KEY_FILE, LOGS_DIR, NODES_FILE, WORKER_KEY_FILE

__all__ = ["render_script", "sbatch_options", "SIGNAL_LEAD_SECONDS"]

SIGNAL_LEAD_SECONDS = 120
"""Slurm sends SIGTERM to every step this long before the time limit, so that workers can drain."""
_INDENT = "    "


def render_script(plan: JobPlan) -> str:
    parts = [_header(plan), _environment(plan), _run_dir(plan), _setup(plan), _signals()]
    parts += [_step(plan, step) for step in plan.steps]
    parts.append(_footer())
    return "\n".join(parts)


def sbatch_options(cfg: SlurmConfig) -> list[tuple[str, str | None]]:
    """The job's sbatch options in header order, (flag without dashes, value or None for a bare
    flag); the script's header and the submitit submission are both made from this list."""
    options: list[tuple[str, str | None]] = [
        ("job-name", cfg.job_name), ("nodes", str(cfg.nodes)), ("time", cfg.time_limit)]
    options += [(flag, value) for flag, value in
                (("partition", cfg.partition), ("account", cfg.account), ("qos", cfg.qos)) if value is not None]
    if cfg.gpus_per_node:
        options.append(("gpus-per-node", str(cfg.gpus_per_node)))
    if cfg.cpus_per_node is None:
        options.append(("exclusive", None))
    else:
        options += [("ntasks-per-node", "1"), ("cpus-per-task", str(cfg.cpus_per_node))]
    if cfg.mem is not None:
        options.append(("mem", cfg.mem))
    options += [("output", "%x-%j.out"), ("signal", f"TERM@{SIGNAL_LEAD_SECONDS}")]
    for line in cfg.extra_sbatch:
        flag, _, value = line.lstrip("-").partition("=")
        options.append((flag, value or None))
    return options


_OPTION_NOTES = {
    "exclusive": "Whole nodes: steps share each node's CPUs (they overlap).",
    "output": "The script's own output; each step logs to <run dir>/logs/<step>.log.",
    "signal": f"SIGTERM to every step {SIGNAL_LEAD_SECONDS} s before the time limit, so that workers drain.",
}


def _header(plan: JobPlan) -> str:
    names = ", ".join(s.name for s in plan.steps)
    lines = [
        "#!/bin/bash",
        f"# {plan.title}",
        "# Rendered by `disagg render`; `sbatch` this file as it is, or edit it first.",
        *textwrap.wrap(f"{len(plan.steps)} steps run concurrently in one allocation: {names}.",
                       width=96, initial_indent="# ", subsequent_indent="#   "),
    ]
    for flag, value in sbatch_options(plan.slurm):
        if flag in _OPTION_NOTES:
            lines.append(f"# {_OPTION_NOTES[flag]}")
        lines.append(f"#SBATCH --{flag}" if value is None else f"#SBATCH --{flag}={value}")
    return "\n".join([*lines, "", "set -euo pipefail"]) + "\n"


def _environment(plan: JobPlan) -> str:
    setup = plan.slurm.env_setup.strip()
    if not setup:
        return ""
    return "# ---- environment (slurm.env_setup) ----\n" + setup + "\n"


def _run_dir(plan: JobPlan) -> str:
    root = plan.slurm.run_root.rstrip("/")
    base = root if root.startswith("/") else f"$SLURM_SUBMIT_DIR/{root}"
    return "\n".join([
        "# ---- run directory, on a filesystem every node shares (see slurm/rendezvous.py) ----",
        "# Workers find the orchestrator here and register with it; `disagg status`, `logs` and",
        "# `down` read it from the submitting machine. `disagg up` makes it (DISAGG_RUN_DIR) before",
        "# submitting; submitted by hand, the job makes its own.",
        f'RUN_DIR="${{DISAGG_RUN_DIR:-{base}/$SLURM_JOB_NAME-$SLURM_JOB_ID}}"',
        f'mkdir -p "$RUN_DIR/{LOGS_DIR}"',
        'export DISAGG_RUN_DIR="$RUN_DIR"',
        "# The key that signs KV handles between workers, and the key every worker requires of its",
        "# callers: one each per deployment, owner-only (0600).",
        *(f'[[ -s "$RUN_DIR/{name}" ]] || '
          f'(umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d \' \\n\' > "$RUN_DIR/{name}")'
          for name in (KEY_FILE, WORKER_KEY_FILE)),
        "# Steps are pinned by node index: NODES[i] is the i-th node of the allocation.",
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f'printf \'%s\\n\' "${{NODES[@]}}" > "$RUN_DIR/{NODES_FILE}"',
        "# Steps overlap, so each may use all of its node's CPUs; TP ranks split them.",
        'CPUS="$SLURM_CPUS_ON_NODE"',
        "",
    ])


def _setup(plan: JobPlan) -> str:
    if not plan.setup:
        return ""
    container = plan.slurm.container
    prefix = ""  # the setup runs where the steps do: in their image when there is one
    if container is not None:
        prefix = _container_words(plan.slurm, container) + " "
        if container.runtime == "pyxis":  # pyxis reaches srun's steps only, not the batch shell
            prefix = f'srun --overlap --nodes=1 --ntasks=1 -w "${{NODES[0]}}" {prefix}'
    commands = [prefix + " ".join(_shell_word(arg) for arg in argv) for argv in plan.setup]
    where = "in the batch shell" if container is None else "in the container"
    return "\n".join([f"# ---- setup, once, {where} before any step ----", *commands, ""])


def _container_words(slurm: SlurmConfig, container: ContainerConfig) -> str:
    """pyxis: srun's container options; apptainer: the ``apptainer exec`` that wraps a command."""
    mounts = ",".join(container.mounts)
    if container.runtime == "pyxis":
        return f"--container-image={shlex.quote(container.image)}" + \
            (f" --container-mounts={shlex.quote(mounts)}" if mounts else "")
    gpus = " --nv" if slurm.gpus_per_node else ""  # the host's NVIDIA driver inside the container
    return f"apptainer exec{gpus}" + (f" --bind={shlex.quote(mounts)}" if mounts else "") + \
        f" {shlex.quote(container.image)}"


def _signals() -> str:
    return "\n".join([
        "# ---- SIGTERM to this script (scancel --batch, kill) goes on to every step ----",
        "# (scancel and the time limit signal the steps themselves.) srun answers SIGTERM by",
        "# killing its tasks; scancel --signal delivers SIGTERM to them instead, so that workers drain.",
        "STEP_PIDS=()",
        "forward_term() {",
        "    trap - TERM INT",
        '    scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || kill -TERM "${STEP_PIDS[@]}" 2>/dev/null || true',
        "    wait",
        "    exit 143",
        "}",
        "trap forward_term TERM INT",
        "",
    ])


def _step(plan: JobPlan, step: Step) -> str:
    hosts = ",".join(f"${{NODES[{n}]}}" for n in step.nodes)
    cpus = '"$CPUS"' if step.tasks_per_node == 1 else f'"$((CPUS / {step.tasks_per_node}))"'
    srun = ["srun --overlap", f"--job-name={step.name}", f"--nodes={len(step.nodes)}", f"--ntasks={step.num_tasks}",
            f"--ntasks-per-node={step.tasks_per_node}", f"--cpus-per-task={cpus}"]
    lines = [" ".join(srun)]
    if step.num_tasks > 1:
        # One PMIx world of num_tasks ranks; a rank that dies takes the world down with it.
        lines.append("--mpi=pmix --kill-on-bad-exit=1 --label")
    if step.gpus_per_node:  # Slurm allots the GPUs and sets each task's CUDA_VISIBLE_DEVICES
        lines.append(f"--gres=gpu:{step.gpus_per_node}" + (f" --gpu-bind={step.gpu_bind}" if step.gpu_bind else ""))
    lines.append(f'-w "{hosts}" --output="$RUN_DIR/{LOGS_DIR}/{step.name}.log"')
    if plan.slurm.container is not None:  # srun's pyxis options, or the apptainer exec of the command
        lines.append(_container_words(plan.slurm, plan.slurm.container))
    if step.env:
        lines.append("env " + " ".join(f"{key}={_shell_word(value)}" for key, value in step.env))
    lines += _wrap_command([_shell_word(arg) for arg in step.argv])
    lines[-1] += " &"
    comment = f"# {step.name}: {step.summary}" if step.summary else f"# {step.name}"
    return "\n".join([comment, (" \\\n" + _INDENT).join(lines), "STEP_PIDS+=($!)", ""])


def _wrap_command(words: list[str], width: int = 96) -> list[str]:
    """The command on lines of at most ``width`` characters where it can, breaking only before a
    ``--flag`` (a flag stays with its value) or before a ``--`` separator."""
    groups: list[str] = []
    for word in words:
        if groups and not word.startswith("-"):
            groups[-1] += " " + word
        else:
            groups.append(word)
    lines = [groups[0]]
    for group in groups[1:]:
        if len(lines[-1]) + 1 + len(group) <= width and not group.startswith("-- "):
            lines[-1] += " " + group
        else:
            lines.append(group)
    return lines


def _footer() -> str:
    return "\n".join([
        'echo "disagg: ${#STEP_PIDS[@]} steps started; run directory $RUN_DIR"',
        "# Until every step has ended (or SIGTERM: see forward_term).",
        "wait",
        "",
    ])


def _shell_word(arg: str) -> str:
    """shlex.quote, except that ``{run_dir}`` becomes a double-quoted "$RUN_DIR"."""
    return '"$RUN_DIR"'.join(shlex.quote(piece) if piece else "" for piece in arg.split(RUN_DIR))
