"""``dora bench weights`` end to end at a tiny size: both paths deliver verified bytes to
every engine and the table has a row per model and path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dora.bench import weights as bench_weights
from dora.cli import app

pytestmark = pytest.mark.nats


def test_bench_weights_saves_a_row_per_model_and_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench_weights, "MODELS", ("tiny",))
    result = CliRunner().invoke(
        app, ["bench", "weights", "--rounds", "1", "--results-dir", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    saved = json.loads(next(tmp_path.glob("weights-*.json")).read_text())
    rows = saved["rows"]
    assert [(r["model"], r["path"]) for r in rows] == [
        ("tiny", "objectstore"),
        ("tiny", "broadcast"),
    ]
    assert all(r["s_per_version"] > 0 and r["engines"] == 2 for r in rows)
    ratio = rows[0]["s_per_version"] / rows[1]["s_per_version"]
    assert rows[0]["objectstore_over_broadcast"] == pytest.approx(ratio, abs=0.01)
