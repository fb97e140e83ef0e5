"""``dora run --set STAGE.path=VALUE`` and ``--max-steps``: applied before validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from dora.pipeline import PipelineConfigError, load_pipeline, read_pipeline_file
from dora.pipeline.overrides import OverrideError, apply_overrides, parse_override

QUICKSTART = Path(__file__).parents[2] / "pipelines" / "quickstart.yaml"


def stage_config(spec, kind: str) -> dict:
    return next(s.config for s in spec.stages if s.type == kind)


def test_values_are_read_as_yaml() -> None:
    assert parse_override("learner.learner.max_steps=5") == (["learner", "learner", "max_steps"], 5)
    assert parse_override("generator.engine={num_blocks: 8}")[1] == {"num_blocks": 8}
    assert parse_override("x.mode=dora")[1] == "dora"
    assert parse_override("x.flag=true")[1] is True
    with pytest.raises(OverrideError, match=r"STAGE\.path\.to\.field=VALUE"):
        parse_override("generator.replicas")


def test_overrides_reach_stage_configs_and_top_level_keys() -> None:
    spec = read_pipeline_file(
        QUICKSTART,
        [
            "generator.replicas=3",
            "learner.learner.optim.lr=0.001",
            "run_id=mine",
            "dispatcher.seed=4",
        ],
    )
    dispatcher, learner = stage_config(spec, "dispatcher"), stage_config(spec, "learner")
    assert next(s for s in spec.stages if s.type == "generator").replicas == 3
    assert dispatcher["seed"] == 4
    assert learner["learner"]["optim"]["lr"] == 0.001
    assert learner["learner"]["optim"]["warmup_steps"] == 5  # siblings are kept
    assert spec.run_id == "mine"


def test_max_steps_sets_the_learner_and_its_schedule() -> None:
    spec = read_pipeline_file(QUICKSTART, max_steps=7)
    learner = stage_config(spec, "learner")["learner"]
    assert learner["max_steps"] == 7 and learner["optim"]["total_steps"] == 7


def test_a_bad_override_names_the_stage_or_field() -> None:
    known = r"stages: dispatcher, generator, learner"
    with pytest.raises(PipelineConfigError, match=rf"no stage named .learnr.; {known}"):
        read_pipeline_file(QUICKSTART, ["learnr.learner.max_steps=5"])
    with pytest.raises(PipelineConfigError, match="'run_id' has no fields"):
        read_pipeline_file(QUICKSTART, ["run_id.x=1"])
    with pytest.raises(OverrideError, match="not a mapping"):
        apply_overrides({"stages": [{"type": "a", "config": {"x": 1}}]}, ["a.x.y=2"])


def test_a_wrong_type_fails_at_load_naming_the_field() -> None:
    from dora.pipeline import load_pipeline

    with pytest.raises(PipelineConfigError, match=r"stages\[6\]\.config\.count"):
        load_pipeline(QUICKSTART, overrides=["prompt_source.count=many"])


def test_eval_headline_states_the_gain_with_its_standard_error() -> None:
    from dora.cli.run_cmd import eval_headline

    results = {
        "start_accuracy": 0.008,
        "final_accuracy": 0.041,
        "gain_accuracy": 0.033,
        "gain_accuracy_se": 0.0065,
    }
    line = eval_headline(results)
    assert line is not None and "0.8% -> 4.1%" in line and "+3.3 ± 0.7 points" in line
    assert eval_headline({"steps": 3}) is None


def test_smoke_run_is_a_few_steps_without_the_held_out_eval() -> None:
    from dora.cli.run_cmd import SMOKE_OVERRIDES, SMOKE_STEPS

    pipe = load_pipeline(QUICKSTART, overrides=SMOKE_OVERRIDES, max_steps=SMOKE_STEPS)
    (learner,) = [s for s in pipe.stages if s.name == "learner"]
    assert learner.config.learner["max_steps"] == SMOKE_STEPS
    assert learner.config.learner["optim"]["total_steps"] == SMOKE_STEPS
    assert sum(learner.config.eval.set.counts()) == 0


def test_shared_settings_are_stated_once_and_overridden_in_one_place() -> None:
    plain = read_pipeline_file(QUICKSTART)
    model = stage_config(plain, "learner")["model"]
    assert stage_config(plain, "generator")["model"] == stage_config(plain, "dispatcher")["model"]
    assert stage_config(plain, "generator")["model"] == model
    spec = read_pipeline_file(QUICKSTART, ["prompt_source.task_config.max_steps=30"])
    assert stage_config(spec, "prompt_source")["task_config"]["max_steps"] == 30
    # the same anchor feeds the eval's task config: an override of one use is not a second
    assert stage_config(spec, "learner")["eval"]["task_config"]["max_steps"] == 60


def test_x_keys_hold_anchors_and_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("x-common: &c {count: 3}\nstages:\n  - type: prompt_source\n    config: *c\n")
    spec = read_pipeline_file(path)
    assert stage_config(spec, "prompt_source") == {"count": 3}
