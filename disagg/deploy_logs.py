"""``disagg logs [NAME] [-f]``: a deployment's logs, read from its run directory.

The logs stay on disk after ``disagg down`` (``<run dir>/logs/<name>.log`` and
the supervisor's ``<run dir>/up.log``), so this works on a stopped deployment
too. ``-f`` follows like ``tail -f``: the last lines, then whatever is
appended, prefixed with ``[name]`` when several logs are followed, picking up
logs that appear later (a process started after the command) and starting
over at a log that was truncated; it runs until interrupted (SIGINT or SIGTERM:
exit 0; a closed pipe: 141, as ``disagg.cli`` handles it).
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["print_logs", "follow_logs", "tail"]

FOLLOW_POLL_SECONDS = 0.25


def tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _log_paths(run_dir: Path, name: str | None) -> list[Path] | str:
    """The logs to show, or why there are none (one line)."""
    logs = sorted((run_dir / "logs").glob("*.log"))
    if name is None:
        return logs or f"no logs in {run_dir / 'logs'}"
    if name == "supervisor":
        return [run_dir / "up.log"]
    path = run_dir / "logs" / f"{name}.log"
    if path.exists():
        return [path]
    return f"no log {name!r} in {run_dir / 'logs'}; have: supervisor, {', '.join(p.stem for p in logs)}"


def print_logs(run_dir: Path, name: str | None, lines: int, follow: bool) -> int:
    paths = _log_paths(run_dir, name)
    if isinstance(paths, str):
        print(f"disagg logs: {paths}", file=sys.stderr)
        return 1
    if follow:
        return follow_logs(run_dir, paths if name else None, lines)
    if name is not None:
        sys.stdout.write(paths[0].read_text(errors="replace"))
        return 0
    for path in paths:
        print(f"==> {path.stem} <==\n{tail(path, lines)}")
    return 0


class _Followed:
    def __init__(self, path: Path, prefix: str) -> None:
        self.path, self.prefix = path, prefix
        self.offset = 0
        self.pending = b""

    def read_new(self) -> Iterator[str]:
        """Complete new lines (a line still being written waits for its newline)."""
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, 2)
                if size < self.offset:  # truncated: start over
                    self.offset, self.pending = 0, b""
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        self.offset += len(data)
        *complete, self.pending = (self.pending + data).split(b"\n")
        for line in complete:
            yield self.prefix + line.decode(errors="replace")


def follow_logs(run_dir: Path, paths: list[Path] | None, lines: int) -> int:
    """``paths`` None: every log of the run dir, including ones created while following."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    followed: dict[Path, _Followed] = {}

    def add(path: Path, tail_lines: int | None) -> None:
        """``tail_lines`` None: a log new since we started, all of it is new."""
        entry = followed[path] = _Followed(path, "" if paths is not None else f"[{path.stem}] ")
        if tail_lines is not None:
            first = list(entry.read_new())  # reading moves the offset: nothing appended meanwhile is lost
            _emit(iter(first[-tail_lines:] if tail_lines else []))

    try:
        for path in paths or sorted((run_dir / "logs").glob("*.log")):
            add(path, lines)
        while True:
            if paths is None:
                for path in sorted((run_dir / "logs").glob("*.log")):
                    if path not in followed:
                        add(path, None)
            for entry in followed.values():
                _emit(entry.read_new())
            time.sleep(FOLLOW_POLL_SECONDS)
    except KeyboardInterrupt:
        return 0


def _emit(lines: Iterator[str]) -> None:
    for line in lines:
        sys.stdout.write(line + "\n")
    sys.stdout.flush()
