"""The one output format of every benchmark: a rich table on the terminal, rows saved as JSON.

Usage (in a ``dora bench <name>`` command)::

    from dora.bench.report import print_table, save_rows

    rows = [{"impl": "raw nats-py", "events_per_s": 2100.0}, {"impl": "NatsBus", ...}]
    print_table("bus throughput", rows)
    path = save_rows("bus", rows, meta={"events": 5000})   # runs/bench/bus-<UTC time>.json

A row is a flat dict of JSON values; every row of a table should have the same keys (missing
ones print as blank). Floats print with 4 significant digits; the JSON keeps full precision.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

Row = Mapping[str, Any]
DEFAULT_DIR = Path("runs/bench")


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_table(title: str, rows: Sequence[Row], console: Console | None = None) -> Table:
    """Print ``rows`` as a table whose columns are the union of their keys, in first-seen order."""
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    table = Table(title=title)
    for name in columns:
        justify = "left" if name in _text_columns(rows, name) else "right"
        table.add_column(name, justify=justify, overflow="fold")
    for row in rows:
        table.add_row(*(_cell(row.get(name)) for name in columns))
    if console is None:  # off a terminal (a log file) rich assumes 80 columns and folds cells
        console = Console() if sys.stdout.isatty() else Console(width=240)
    console.print(table)
    return table


def _text_columns(rows: Sequence[Row], name: str) -> set[str]:
    return {name} if any(isinstance(r.get(name), str) for r in rows) else set()


def save_rows(
    name: str,
    rows: Sequence[Row],
    meta: Mapping[str, Any] | None = None,
    results_dir: Path = DEFAULT_DIR,
) -> Path:
    """Save ``{"bench", "created_at", "host", "meta", "rows"}`` to
    ``results_dir/<name>-<UTC YYYYmmdd-HHMMSS>.json``; returns the path."""
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = results_dir / f"{name}-{stamp}.json"
    n = 1
    while path.exists():  # two runs within a second keep both files
        n += 1
        path = results_dir / f"{name}-{stamp}-{n}.json"
    record = {
        "bench": name,
        "created_at": time.time(),
        "host": {"platform": platform.platform(), "python": platform.python_version()},
        "meta": dict(meta or {}),
        "rows": [dict(r) for r in rows],
    }
    path.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    return path
