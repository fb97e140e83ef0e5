"""`dora bench modes --task`: the run spec follows the quickstart with the mode and K swapped."""

from __future__ import annotations

import pytest
import typer
import yaml

from dora.bench.modes import cli
from dora.bench.modes_task import _spec


def _stage(spec: dict, kind: str) -> dict:
    return next(e["config"] for e in spec["stages"] if e["type"] == kind)


def test_spec_sets_mode_seed_steps_and_staleness_everywhere() -> None:
    spec = _spec("sync", seed=3, steps=8, task="arithmetic", every=2, staleness=1)
    rollout, learner = _stage(spec, "rollout"), _stage(spec, "learner")
    assert rollout["mode"] == "sync" and rollout["seed"] == 3
    assert rollout["staleness_bound"] == 1 and learner["learner"]["staleness_bound"] == 1
    assert learner["learner"]["max_steps"] == 8 and learner["learner"]["checkpoint_every"] == 2
    assert learner["learner"]["optim"]["total_steps"] == 8  # the quickstart's cosine spans it


def test_spec_keeps_the_quickstart_staleness_by_default() -> None:
    base = _spec("dora", seed=0, steps=4, task="arithmetic", every=1)
    bumped = _spec("dora", seed=0, steps=4, task="arithmetic", every=1, staleness=5)
    assert _stage(base, "rollout")["staleness_bound"] != 5
    assert _stage(bumped, "rollout")["staleness_bound"] == 5


def test_staleness_without_task_is_refused() -> None:
    with pytest.raises(typer.BadParameter, match="--staleness"):
        cli(
            fleet="emulated",
            task=None,
            modes="dora",
            engines=2,
            steps=1,
            seeds="0",
            preset="dense-32b",
            workload="dapo-16k",
            time_scale=50.0,
            staleness=1,
            out=None,
        )


def test_spec_switches_every_rollout_stage_of_the_quickstart(tmp_path) -> None:
    from dora.pipeline import load_pipeline

    spec = _spec("partial", seed=3, steps=8, task="tally", every=2, staleness=1)
    for kind in ("dispatcher", "generator", "orchestrator"):
        assert _stage(spec, kind)["mode"] == "partial", kind
    assert _stage(spec, "dispatcher")["seed"] == 3
    assert _stage(spec, "dispatcher")["staleness_bound"] == 1
    path = tmp_path / "partial.yaml"
    path.write_text(yaml.safe_dump(spec))
    load_pipeline(path)  # one mode everywhere: it loads
