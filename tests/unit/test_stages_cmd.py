"""``dora stages``: the YAML reference comes from the same models that validate a pipeline."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from dora.cli import app
from dora.cli.stages_cmd import config_rows
from dora.registry import stage_types
from dora.stages.verifier import VerifierStageConfig

runner = CliRunner()


def test_lists_every_registered_type() -> None:
    result = runner.invoke(app, ["stages"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for name in stage_types():
        assert f" {name} " in result.output


def test_one_types_fields_with_nested_models_expanded() -> None:
    result = runner.invoke(app, ["stages", "learner"], env={"COLUMNS": "240"})
    assert result.exit_code == 0
    assert "learner.staleness_bound" in result.output  # a nested LearnerConfig field
    assert "learner.optim.lr" in result.output  # two levels down


def test_rows_carry_type_default_and_description() -> None:
    rows = {row[0]: row for row in config_rows(VerifierStageConfig)}
    assert rows["verifier"] == ("verifier", "str", "'exact_match'", "A dora.rewards name.")
    assert rows["verifier_config"][2] == "{}"


def test_an_unknown_type_is_a_short_error() -> None:
    result = runner.invoke(app, ["stages", "nope"])
    assert result.exit_code == 2
    assert "unknown stage type 'nope'" in result.output


def test_the_readme_documents_every_built_in_type_and_links_only_files_of_the_clone() -> None:
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    for name in stage_types():
        assert f"| `{name}` |" in readme
    for page in (readme, *(p.read_text() for p in (root / "docs").glob("*.md"))):
        for target in re.findall(r"\]\(([^)#]+)\)", page):
            if not target.startswith("http"):
                assert (root / target).exists() or (root / "docs" / target).exists(), target
        assert "../shared" not in page
