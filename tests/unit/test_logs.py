"""Log routing: every line at the file level to log.jsonl, only the console level to people."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import structlog

from dora import logs


def test_file_gets_info_and_up_console_only_warnings(tmp_path: Path) -> None:
    console = io.StringIO()
    path = logs.configure(tmp_path, "warning", console=console)
    try:
        log = structlog.get_logger("t").bind(stage="learner")
        log.debug("too_fine", x=1)
        log.info("learner_step", step=3)
        log.warning("stalled", missing=2)
    finally:
        logs.configure(None, "info", console=io.StringIO())  # close the file
    assert path == tmp_path / logs.LOG_FILE
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["event"] for e in lines] == ["learner_step", "stalled"]
    assert lines[0]["step"] == 3 and lines[0]["stage"] == "learner" and lines[0]["level"] == "info"
    shown = console.getvalue()
    assert "stalled" in shown and "learner_step" not in shown and "too_fine" not in shown


def test_json_console_lines_parse(tmp_path: Path) -> None:
    console = io.StringIO()
    logs.configure(None, "info", console=console, console_json=True)
    try:
        structlog.get_logger("t").info("hello", n=2)
    finally:
        logs.configure(None, "info", console=io.StringIO())
    event = json.loads(console.getvalue())
    assert event["event"] == "hello" and event["n"] == 2


def test_notices_of_long_phases_reach_stderr_unless_quiet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs.configure(tmp_path / "a")
    logs.notice("warm start: step 5/450, about 3.1 min left")
    assert capsys.readouterr().err == "warm start: step 5/450, about 3.1 min left\n"
    logs.configure(tmp_path / "b", console_level="error")  # --quiet
    logs.notice("building the C++ kernel")
    assert capsys.readouterr().err == ""
    logs.configure(None)
