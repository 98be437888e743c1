"""A run dir outside ./.disagg is found by the bare ``status``, ``down`` and ``logs`` all the same.

Those commands look for deployments under ``./.disagg`` (``disagg.deployment.RUNS_ROOT``).
When the YAML's ``run_dir`` (or ``up --run-dir``) puts a deployment elsewhere,
``up`` leaves a symbolic link ``./.disagg/<name> -> <run dir>``, so that what
``up`` says (``disagg down`` stops it) is true from the same directory. The
link stays after ``down``: ``logs`` still finds the last run's logs through it;
the next ``up`` of that name replaces it. A real directory of that name (an
earlier run in the default place) is never replaced: then ``up`` names the
run dir in the command it prints instead.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["link_run_dir", "down_command"]


def link_run_dir(runs_root: Path, name: str, run_dir: Path) -> bool:
    """Make ``runs_root/name`` lead to ``run_dir``; True when the bare commands will find it there."""
    target = run_dir.resolve()
    link = runs_root / name
    if link.resolve() == target:  # the default place, or already linked
        return True
    if target.parent == runs_root.resolve():  # under ./.disagg by another name: found as it is
        return True
    if link.exists() and not link.is_symlink():
        return False
    runs_root.mkdir(parents=True, exist_ok=True)
    aside = runs_root / f".{name}.link"
    aside.unlink(missing_ok=True)
    aside.symlink_to(target, target_is_directory=True)
    os.replace(aside, link)  # atomic: a link to a previous run dir is replaced, never missing
    return True


def down_command(found_bare: bool, run_dir: Path) -> str:
    """The ``down`` that stops the deployment ``up`` just started, for its ready line."""
    return "disagg down" if found_bare else f"disagg down --run-dir {run_dir.resolve()}"
