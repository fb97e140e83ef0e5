"""Held-out evaluation: greedy accuracy and avg@k over temperature-1 samples."""

from __future__ import annotations

from typing import Any

import pytest

import dora.models.evaluate as ev
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
