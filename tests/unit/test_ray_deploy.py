"""``dora run --ray`` without a cluster: what it says when Ray is not installed, and which
option combinations it refuses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dora.cli import app
from dora.deploy.ray import RAY_MISSING, require_ray
from dora.pipeline import PipelineError


def test_without_ray_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(PipelineError, match=r"pip install 'dora-rl\[ray\]'"):
        require_ray()


def test_dora_run_ray_without_ray_exits_with_the_install_hint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, repo_root: Path
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    pipeline = repo_root / "pipelines" / "echo.yaml"
    result = CliRunner().invoke(
        app, ["run", str(pipeline), "--ray", "--run-dir", str(tmp_path / "run")]
    )
    assert result.exit_code == 1, result.output
    assert RAY_MISSING.split(":")[0] in " ".join(result.output.split())


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--ray", "--processes"], "pick one"),
        (["--ray-address", "127.0.0.1:1"], "--ray-address is for --ray"),
    ],
)
def test_ray_options_that_contradict_are_refused(
    tmp_path: Path, repo_root: Path, args: list[str], needle: str
) -> None:
    pipeline = repo_root / "pipelines" / "echo.yaml"
    result = CliRunner().invoke(app, ["run", str(pipeline), *args])
    assert result.exit_code == 2
    assert needle in " ".join(result.output.split())


def test_the_cluster_example_loads_with_its_placement(repo_root: Path) -> None:
    """``examples/ray_cluster.yaml``: a valid pipeline whose engines spread over machines."""
    from dora.pipeline import load_pipeline
    from dora.pipeline.spec import read_pipeline_file

    path = repo_root / "examples" / "ray_cluster.yaml"
    load_pipeline(path)  # every stage's config is valid
    entries = {e.type: e for e in read_pipeline_file(path).stages}
    generator, learner = entries["generator"], entries["learner"]
    assert generator.placement == "spread" and generator.replicas == 4
    assert generator.resources is not None and generator.resources.custom == {"engine": 1}
    assert learner.resources is not None and learner.resources.custom == {"trainer": 1}
