"""Held-out evaluation: greedy accuracy and avg@k over temperature-1 samples."""

from __future__ import annotations

from typing import Any

import pytest

import dora.training.evaluate as ev
from dora.models.tokenizer import CharTokenizer
from dora.tasks import make_task


def test_greedy_and_sampled_accuracy_are_scored_separately(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    task = make_task("arithmetic", seed=0, max_terms=4)
    calls: list[dict[str, Any]] = []

    def fake_complete(model: object, tokenizer: object, task: object, prompts: list, **kw: Any):
        calls.append({"n": len(prompts), **kw})
        sampled = kw.get("temperature", 0.0) > 0
        right_every = 4 if sampled else 2  # greedy: half right; sampled: a quarter
        return [
            f"answer: {p.answer}" if i % right_every == 0 else "answer: -1"
            for i, p in enumerate(prompts)
        ]

    monkeypatch.setattr(ev, "complete", fake_complete)
    result = ev.evaluate_task(
        object(), CharTokenizer.build(), task, eval_prompts=8, group_prompts=0, samples=4
    )
    assert result["accuracy"] == 0.5 and result["n"] == 8
    assert result["sampled_accuracy"] == 0.25
    assert calls[1] == {"n": 32, "temperature": 1.0, "seed": 2}  # 8 prompts x 4 samples
    assert result["mean_length"] == pytest.approx(
        sum(
            len(f"answer: {p.answer}") if i % 2 == 0 else len("answer: -1")
            for i, p in enumerate(task.prompts("eval", 8))
        )
        / 8
    )
    no_samples = ev.evaluate_task(
        object(), CharTokenizer.build(), task, eval_prompts=8, group_prompts=0
    )
    assert "sampled_accuracy" not in no_samples


def test_learner_stage_evaluation_on_the_frozen_set(tmp_path: Any) -> None:
    """The learner stage's eval: start and final on one frozen set, paired gain with its
    clustered SE, per-problem scores saved, and the start policy's scores cached beside it."""
    import json

    from dora.models import build_model, save_pretrained
    from dora.stages.learner import LearnerStage

    start_model, tok = build_model("tiny", seed=1, num_hidden_layers=1)
    start = save_pretrained(start_model, tmp_path / "start", tok)
    final = save_pretrained(
        build_model("tiny", seed=2, num_hidden_layers=1)[0], tmp_path / "f", tok
    )
    stage = LearnerStage(
        model={"path": str(start)},
        eval={
            "task_config": {"max_terms": 4},
            "set": {"strata": [[3, 3], [4, 4]], "per_stratum": 3},
            "samples": 2,
        },
    )
    stage.model_dir, stage.tokenizer, stage.run_dir = start, tok, tmp_path
    result = stage._evaluate(final)
    assert result["eval_set"]["n"] == 6 and result["eval_set"]["strata"] == {"3": 3, "4": 3}
    for metric in ("accuracy", "avg@2"):
        assert result[f"gain_{metric}"] == pytest.approx(
            result[f"final_{metric}"] - result[f"start_{metric}"]
        )
    assert set(result["gain"]["greedy"]["strata"]) == {"3", "4"}
    cached = list(start.glob("eval-*-k2.json"))
    assert len(cached) == 1 and set(json.loads(cached[0].read_text())) >= {"greedy", "avg@2"}
    cached[0].write_text(json.dumps({k: [1.0] * 6 for k in ("greedy", "greedy_length", "avg@2")}))
    again = stage._evaluate(final)  # the start policy's scores now come from the cache
    assert again["start_accuracy"] == 1.0 and again["final_accuracy"] == result["final_accuracy"]
