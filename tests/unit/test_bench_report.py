"""The shared benchmark output: a table on the console, rows saved as JSON."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from dora.bench.report import print_table, save_rows


def test_print_table_shows_every_column_and_row() -> None:
    out = io.StringIO()
    rows = [{"impl": "a", "events_per_s": 1234.5678}, {"impl": "b", "extra": 1}]
    print_table("demo", rows, console=Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    for needle in ("demo", "impl", "events_per_s", "extra", "1235", " a ", " b "):
        assert needle in text


def test_save_rows_writes_one_file_per_run(tmp_path: Path) -> None:
    rows = [{"impl": "raw", "events_per_s": 1.5}]
    first = save_rows("bus", rows, meta={"events": 10}, results_dir=tmp_path / "bench")
    second = save_rows("bus", rows, results_dir=tmp_path / "bench")
    assert first != second and first.name.startswith("bus-") and first.suffix == ".json"
    record = json.loads(first.read_text())
    assert record["bench"] == "bus" and record["rows"] == rows and record["meta"] == {"events": 10}
