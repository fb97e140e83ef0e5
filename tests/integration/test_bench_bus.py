"""``dora bench bus`` runs end to end (a smoke test: figures go to the table, not asserts)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from dora.bus.server import NatsServer
from dora.cli import app


def test_bench_bus_prints_and_saves_both_rows(nats_server: NatsServer, tmp_path: Path) -> None:
    args = ["bench", "bus", "--events", "40", "--rounds", "1", "--batch", "8"]
    args += ["--nats", nats_server.url, "--results-dir", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (saved,) = tmp_path.glob("bus-*.json")
    rows = json.loads(saved.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["raw nats-py", "NatsBus"]
    assert all(r["events"] == 40 and r["events_per_s"] > 0 for r in rows)
    assert rows[0]["ratio_vs_raw"] == 1.0
