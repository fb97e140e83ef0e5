"""The console's view of a running pipeline: a live bar per stage on a terminal, a plain line
every ``PLAIN_EVERY_S`` elsewhere (a log file, CI). One view for both ways a run runs: fed
``Pipeline.progress()`` in one process, the processes' merged copy under ``--processes``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

PLAIN_EVERY_S = 10.0
"""Off a terminal, a one-line progress report this often (the live view needs a TTY)."""

Row = tuple[str, int, int | None, str]
"""A stage's name, work done, work expected (if known), and a note."""


def progress_rows(progress: dict[str, dict[str, Any]]) -> list[Row]:
    """One row per stage from ``Pipeline.progress()`` (or the processes' merged copy)."""
    rows = []
    for name, info in progress.items():
        stats = info["stats"]
        done = info.get("done", stats["processed"])
        note = f"in {stats['received']} out {stats['published']}"
        if stats["retried"] or stats["dead_lettered"]:
            note += f" retried {stats['retried']} dead {stats['dead_lettered']}"
        rows.append((name, done, info.get("total"), note))
    return rows


def plain_line(rows: list[Row], tail: str = "") -> str:
    """``progress  learner 12/150 | generator 830 | ...``: every stage's work done."""
    parts = [
        f"{name} {done}/{total}" if total else f"{name} {done}" for name, done, total, _ in rows
    ]
    return "progress  " + " | ".join([*parts, *([tail] if tail else [])])


class ProgressView:
    """Use as a context manager; ``show(rows)`` as often as the counters change."""

    def __init__(self, console: Console, quiet: bool = False) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.console = console
        self.bars = Progress(
            TextColumn("[bold]{task.description:<12}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[extra]}"),
            TimeElapsedColumn(),
            console=console,
            disable=quiet,
        )
        self.plain = not console.is_terminal and not quiet
        self._ids: dict[str, Any] = {}
        self._last_line = time.monotonic()

    def __enter__(self) -> ProgressView:
        self.bars.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bars.__exit__(None, None, None)

    def show(self, rows: list[Row], tail: str = "") -> None:
        """Update the bars (a stage seen for the first time gets one); off a terminal, print
        the plain line when it is due (``tail`` appended to it)."""
        for name, done, total, note in rows:
            if name in self._ids:
                self.bars.update(self._ids[name], completed=done, total=total, extra=note)
            else:
                self._ids[name] = self.bars.add_task(name, total=total, completed=done, extra=note)
        now = time.monotonic()
        if self.plain and now - self._last_line >= PLAIN_EVERY_S:
            self._last_line = now
            self.console.print(plain_line(rows, tail), highlight=False, soft_wrap=True)
