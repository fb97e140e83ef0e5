"""Where structured log lines go: all of them to the run folder, the ones a person needs to
the console.

A run's services log a great deal (a ``weights_loaded`` pair per engine per version, a line
per learner step) that belongs in a file to grep, not on the screen next to the progress
view. ``configure`` sends every event at ``file_level`` and above to ``<run_dir>/log.jsonl``
(one JSON object per line, with ISO timestamps) and events at ``console_level`` and above to
stderr, rendered for people or as JSON.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
from pathlib import Path
from typing import Any, Literal, TextIO

import structlog

LOG_FILE = "log.jsonl"
Level = Literal["debug", "info", "warning", "error"]
LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


class Tee:
    """The last processor: writes an event to the file and/or the console, then drops it."""

    def __init__(
        self,
        file: TextIO | None,
        file_level: int,
        console: TextIO | None,
        console_level: int,
        console_json: bool,
    ) -> None:
        self.file, self.file_level = file, file_level
        self._console, self.console_level = console, console_level
        self.console_json = console_json
        self.pretty = structlog.dev.ConsoleRenderer(colors=self.console.isatty())
        self.lock = threading.Lock()  # engines and the warm start log from threads

    @property
    def console(self) -> TextIO:
        """The given stream, or whatever ``sys.stderr`` is *now* (a test harness or a
        daemon may replace it after configuration)."""
        return self._console if self._console is not None else sys.stderr

    def __call__(self, logger: Any, method: str, event: dict[str, Any]) -> Any:
        level = LEVELS.get(event.get("level", "info"), logging.INFO)
        # a log line must never break the service that writes it (a closed or full stream)
        with self.lock, contextlib.suppress(OSError, ValueError):
            if self.file is not None and level >= self.file_level:
                self.file.write(json.dumps(event, default=str) + "\n")
                self.file.flush()
            if level >= self.console_level:
                line = (
                    json.dumps(event, default=str)
                    if self.console_json
                    else self.pretty(logger, method, dict(event))
                )
                self.console.write(line + "\n")
                self.console.flush()
        raise structlog.DropEvent


def configure(
    run_dir: Path | None,
    console_level: Level = "warning",
    *,
    console_json: bool = False,
    file_level: Level = "info",
    console: TextIO | None = None,
) -> Path | None:
    """Route structlog for this process; returns the log file's path (None without a run
    folder). Calling it again (a second run in one process) closes the previous file."""
    global _open_file, _notices
    _notices = LEVELS[console_level] <= logging.WARNING
    if _open_file is not None:
        _open_file.close()
        _open_file = None
    path = None
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        path = Path(run_dir) / LOG_FILE
        _open_file = path.open("a", encoding="utf-8")
    tee = Tee(
        _open_file,
        LEVELS[file_level],
        console,
        LEVELS[console_level],
        console_json,
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            tee,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            min(LEVELS[file_level], LEVELS[console_level])
        ),
        cache_logger_on_first_use=False,
    )
    return path


_open_file: TextIO | None = None


_notices = True


def notice(text: str) -> None:
    """A plain line for the person watching a long phase (a warm start, a kernel build) when
    no live view shows it: written to stderr unless the console is quiet (``--quiet``)."""
    if _notices:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
