"""``dora eval``: finished runs rescored on another split, from their own pipeline and
overrides, pooled over runs; runs that cannot be pooled are refused with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml
from typer.testing import CliRunner

from dora.cli import app
from dora.models import build_model, load_pretrained, load_tokenizer, save_pretrained
from dora.tasks import make_task
from dora.tasks.evalset import EvalSetSpec, build_eval_set
from dora.training.evaluate import score_pass

TASK = {"max_terms": 4}
STRATA = [[3, 3], [4, 4]]


def policy(path: Path, seed: int) -> Path:
    model, tok = build_model("tiny", seed=seed, num_hidden_layers=1)
    return save_pretrained(model, path, tok)


def finished_run(tmp_path: Path, name: str, start: Path, seed: int) -> Path:
    """A run directory as `dora run` leaves it: run.json naming the pipeline and overrides,
    and the final policy. The pipeline asks for avg@2; the run's override turns it off."""
    pipeline = tmp_path / f"{name}.yaml"
    learner = {
        "model": {"path": str(start)},
        "eval": {
            "task": "arithmetic",
            "task_config": TASK,
            "set": {"strata": STRATA, "per_stratum": 4},
            "samples": 2,
        },
    }
    pipeline.write_text(yaml.safe_dump({"stages": [{"type": "learner", "config": learner}]}))
    run = tmp_path / "runs" / name
    policy(run / "final", seed)
    overrides = ["learner.eval.samples=0"]
    (run / "run.json").write_text(json.dumps({"pipeline": str(pipeline), "overrides": overrides}))
    return run


def test_runs_are_rescored_on_the_dev_split_and_pooled(tmp_path: Path) -> None:
    start = policy(tmp_path / "start", 1)
    runs = [finished_run(tmp_path, f"seed{i}", start, 2 + i) for i in range(2)]
    out = tmp_path / "pooled.json"
    args = ["eval", *map(str, runs), "--split", "dev", "--workers", "1", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "mean of 2" in result.output

    task = make_task("arithmetic", **TASK)
    dev = build_eval_set(task, EvalSetSpec(split="dev", strata=STRATA, per_stratum=4))
    test = build_eval_set(task, EvalSetSpec(split="eval", strata=STRATA, per_stratum=4))
    assert dev.fingerprint != test.fingerprint
    gains = []
    for run in runs:
        summary = json.loads((run / "eval-dev.json").read_text())
        scores = json.loads((run / "eval_scores-dev.json").read_text())
        assert summary["eval_set"]["fingerprint"] == dev.fingerprint
        assert summary["start_policy"] == str(start)
        assert "gain_avg@2" not in summary  # the run's override, not the pipeline's value
        model, tok = load_pretrained(run / "final"), load_tokenizer(run / "final")
        alone = score_pass(model, tok, task, dev, "greedy")
        assert scores["final"] == alone  # this run's policy, on the dev problems
        gains.append(summary["gain_accuracy"])
    assert (start / f"eval-{dev.fingerprint}-k0.json").is_file()  # the start is scored once
    pooled = json.loads(out.read_text())["pooled"]["metrics"]["greedy"]
    assert pooled["gain_mean"] == np.mean(gains)
    assert pooled["gain_sd"] == np.std(gains, ddof=1)


def test_runs_from_different_starts_are_not_pooled(tmp_path: Path) -> None:
    one = finished_run(tmp_path, "a", policy(tmp_path / "start_a", 1), 2)
    other = finished_run(tmp_path, "b", policy(tmp_path / "start_b", 5), 3)
    result = CliRunner().invoke(app, ["eval", str(one), str(other), "--workers", "1"])
    assert result.exit_code == 2
    assert "it was trained from" in result.output
    assert not (one / "eval-eval.json").exists()


def test_a_folder_without_a_finished_run_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["eval", str(tmp_path)])
    assert result.exit_code == 2
    assert "no finished run" in result.output
