"""``dora sim`` prints the table and saves JSON + PNG."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from dora.cli import app


def test_dora_sim_small(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(
        app,
        [
            "sim", "--engines", "4", "--modes", "sync,partial,dora", "--steps", "2",
            "--batch-groups", "6", "--group-size", "2", "--preset", "dense-7b",
            "--json", str(out),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [r["mode"] for r in data["results"]] == ["sync", "partial", "dora"]
    assert data["results"][0]["vs_sync"] == 1.0
    assert out.with_suffix(".png").stat().st_size > 0
    assert "tokens/s" in result.output


def test_dora_sim_rejects_unknown_mode() -> None:
    result = CliRunner().invoke(app, ["sim", "--modes", "turbo"])
    assert result.exit_code != 0
    assert "modes" in result.output


def test_dora_sim_start_order_and_max_seqs_reach_the_run(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(
        app,
        [
            "sim", "--engines", "4", "--modes", "dora", "--steps", "2", "--batch-groups", "6",
            "--group-size", "2", "--preset", "dense-7b", "--max-seqs", "5",
            "--start-order", "oracle_request", "--json", str(out),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["config"]["start_order"] == "oracle_request"
    assert data["config"]["max_seqs"] == 5
    bad = CliRunner().invoke(app, ["sim", "--start-order", "shortest"])
    assert bad.exit_code != 0 and "start_order" in bad.output
