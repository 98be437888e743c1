"""Progress while a bench runs: a rich live bar on a terminal, plain lines otherwise (logs, CI)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from disagg.bench.metrics import RequestRecord, RunSummary

__all__ = ["PlainProgress", "RichProgress", "make_progress"]

PLAIN_EVERY_SECONDS = 5.0


class PlainProgress:
    """A line when a level starts, one every few seconds while it runs, and one when it ends."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.label, self.done, self.errors, self.last = "", 0, 0, 0.0

    def _print(self, text: str) -> None:
        print(f"disagg bench: {text}", file=self.stream, flush=True)

    def start_level(self, label: str, total: int | None, duration: float | None) -> None:
        self.label, self.done, self.errors, self.last = label, 0, 0, time.monotonic()
        bounds = " and ".join(b for b in (total and f"{total} requests", duration and f"{duration:g} s") if b)
        self._print(f"{label}: started ({bounds or 'unbounded'})")

    def request_done(self, record: RequestRecord) -> None:
        self.done += 1
        self.errors += not record.ok
        if time.monotonic() - self.last >= PLAIN_EVERY_SECONDS:
            self.last = time.monotonic()
            self._print(f"{self.label}: {self.done} done, {self.errors} errors")

    def end_level(self, summary: RunSummary) -> None:
        p50 = summary.ttft.p50
        ttft = "-" if p50 is None else f"{p50 * 1e3:.0f} ms"
        self._print(f"{self.label}: {summary.num_ok}/{summary.num_requests} ok, {summary.requests_per_s:.2f} req/s, "
                    f"{summary.output_tokens_per_s:.1f} tok/s, TTFT p50 {ttft}")


class RichProgress:
    """rich's live progress bar per level (needs the ``bench`` extra)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("errors {task.fields[errors]}"), TimeElapsedColumn(),
                                 console=self.console)
        self.task: Any = None
        self.errors = 0

    def start_level(self, label: str, total: int | None, duration: float | None) -> None:
        self.errors = 0
        self.progress.start()
        self.task = self.progress.add_task(label, total=total, errors=0)

    def request_done(self, record: RequestRecord) -> None:
        self.errors += not record.ok
        self.progress.update(self.task, advance=1, errors=self.errors)

    def end_level(self, summary: RunSummary) -> None:
        self.progress.stop()
        p50 = summary.ttft.p50
        self.console.print(f"  {summary.requests_per_s:.2f} req/s, {summary.output_tokens_per_s:.1f} tok/s, "
                           f"TTFT p50 {'-' if p50 is None else f'{p50 * 1e3:.0f} ms'}")


def make_progress(stream: TextIO = sys.stderr) -> PlainProgress | RichProgress:
    return RichProgress() if stream.isatty() else PlainProgress(stream)
