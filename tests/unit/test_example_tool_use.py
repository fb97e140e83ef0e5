"""examples/tool_use_by_version.py: per-version-block tool-call rate and accuracy from a run's
recorded scored stream."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location(
        "tool_use", ROOT / "examples/tool_use_by_version.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_split_accuracy_by_whether_the_tool_was_called(tmp_path: Path) -> None:
    events = tmp_path / "events"
    events.mkdir()
    records = [  # (version, tool calls, correct)
        (0, 1, True), (1, 0, False), (3, 2, True), (3, 0, True),
        (10, 1, True), (12, 1, False), (15, 0, False), (19, None, False),
    ]  # fmt: skip
    with (events / "scored.jsonl").open("w") as f:
        for v, calls, ok in records:
            episode = None if calls is None else {"tool_calls": calls}
            f.write(json.dumps({"trajectory": {"version": v, "episode": episode}, "correct": ok}))
            f.write("\n")
    first, second = _load().rows(tmp_path, every=10)
    assert first["versions"] == "0-9" and first["n"] == 4
    assert first["tool_call_rate"] == 0.5 and first["accuracy"] == 0.75
    assert first["acc_with_tool"] == 1.0 and first["acc_without"] == 0.5
    assert second["n"] == 4 and second["tool_call_rate"] == 0.5
    assert second["acc_with_tool"] == 0.5 and second["acc_without"] == 0.0
