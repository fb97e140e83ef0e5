"""``dora bench engine``: workload selection, and a clear error for an unknown one."""

from __future__ import annotations

from typer.testing import CliRunner

from dora.bench.engine import make_workloads
from dora.cli import app


def test_unknown_workload_is_refused_by_name() -> None:
    result = CliRunner().invoke(app, ["bench", "engine", "--workloads", "uniform,bogus"])
    assert result.exit_code != 0
    assert "bogus" in result.output and "--workloads" in result.output


def test_workload_names_start_with_their_selector() -> None:
    names = [w.name.split()[0] for w in make_workloads(quick=True)]
    assert names == ["uniform", "longtail"]  # what --workloads matches on
