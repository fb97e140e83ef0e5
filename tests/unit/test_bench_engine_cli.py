"""``dora bench engine``: workload selection, and a clear error for an unknown one."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dora.bench.engine import Timing, Workload, make_workloads, transformers_bound
from dora.cli import app


def test_unknown_workload_is_refused_by_name() -> None:
    result = CliRunner().invoke(app, ["bench", "engine", "--workloads", "uniform,bogus"])
    assert result.exit_code != 0
    assert "bogus" in result.output and "--workloads" in result.output


def test_workload_names_start_with_their_selector() -> None:
    names = [w.name.split()[0] for w in make_workloads(quick=True)]
    assert names == ["uniform", "longtail"]  # what --workloads matches on


def test_transformers_bound_scales_the_uniform_run_by_each_batch_longest() -> None:
    uniform = Workload("uniform", [[1] * 4] * 64, [256] * 64)
    # batches of 64: longest 512, 256 and 100 (too short to bound: counts 0)
    lengths = [10] * 63 + [512] + [256] * 64 + [100] * 64
    work = Workload("longtail", [[2] * 4] * 192, lengths)
    got = transformers_bound(uniform, Timing(wall=10.0, cpu=12.0), work)
    assert got == Timing(wall=30.0, cpu=36.0)


def test_transformers_bound_needs_a_comparable_uniform_run() -> None:
    work = Workload("longtail", [[2] * 4] * 64, [300] * 64)
    with pytest.raises(ValueError, match="equal lengths"):
        transformers_bound(Workload("u", [[1] * 4] * 64, [256] * 63 + [1]), Timing(1, 1), work)
    with pytest.raises(ValueError, match="prompt length"):
        transformers_bound(Workload("u", [[1] * 5] * 64, [256] * 64), Timing(1, 1), work)


def test_bound_without_uniform_is_refused_by_name() -> None:
    result = CliRunner().invoke(
        app,
        ["bench", "engine", "--workloads", "longtail", "--transformers-longtail", "bound"],
    )
    assert result.exit_code != 0 and "--transformers-longtail" in result.output
