"""What a deployment left running: the processes whose command line names its run directory."""

from __future__ import annotations

import os
from pathlib import Path


def processes_mentioning(text: str) -> list[str]:
    """``pid: command line`` of every process (this one aside) whose command line contains ``text``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and proc.name != str(os.getpid()):
            found.append(f"{proc.name}: {cmdline}")
    return found
