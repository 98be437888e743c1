"""``disagg --version``: the version every server's /version reports, and the checkout's commit."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import disagg
from orchestrator.surface import VERSION

ROOT = Path(__file__).resolve().parents[1]


def test_version_prints_the_served_version_and_the_commit(tmp_path):
    result = subprocess.run([sys.executable, "-m", "disagg.cli", "--version"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=60)
    assert result.returncode == 0 and result.stderr == "", result
    # One version: the package's metadata (pyproject.toml), disagg.__version__ and what /version answers.
    assert VERSION == disagg.__version__ == importlib.metadata.version("disagg")
    line = f"disagg {VERSION}"
    if (ROOT / ".git").exists():  # CI and developers run from a clone
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        line += f" (commit {head})"
    assert result.stdout == line + "\n"
