"""A policy scored against its start on the frozen held-out set: one implementation for the
learner stage (at the end of a run) and ``dora eval`` (afterwards, on another split or many
runs at once).

The start policy's scores are a pure function of its weights and the frozen set, so they are
kept beside the weights (``eval-<fingerprint>-k<samples>.json``): runs from one cached warm
start, and every later ``dora eval`` of them, pay for the start policy once.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dora.tasks.evalset import EvalSetSpec


class EvalConfig(BaseModel):
    """The held-out evaluation of the start and final policies on a frozen eval set."""

    model_config = ConfigDict(extra="forbid")

    task: str = "arithmetic"
    task_config: dict[str, Any] = Field(default_factory=dict)
    set: EvalSetSpec = Field(
        default_factory=EvalSetSpec,
        description="Which distinct held-out problems (split, strata, per_stratum; 0: none).",
    )
    samples: int = Field(
        default=4, ge=0, description="Temperature-1 samples per prompt for avg@k (0: greedy only)."
    )
    workers: int = Field(
        default=2,
        ge=1,
        description="Processes scoring at once: the start and final policies' greedy and "
        "sampled passes are four jobs, each using one core (1: all in this process). "
        "Workers are spawned: a script that runs a pipeline needs the usual "
        '`if __name__ == "__main__":` guard.',
    )


class Scored(BaseModel):
    """One policy against its start: the summary (``eval.json``) and the per-problem scores
    (``eval_scores.json``, to pool seeds or re-analyse without re-scoring)."""

    summary: dict[str, Any]
    scores: dict[str, Any]


def score_against_start(
    cfg: EvalConfig, start: Path, policies: dict[str, Path]
) -> dict[str, Scored]:
    """Each named policy and ``start`` on the frozen set ``cfg`` describes: pooled and
    per-stratum means with standard errors clustered by problem, and the paired gain."""
    from dora.logs import notice
    from dora.tasks import make_task
    from dora.tasks.evalset import build_eval_set
    from dora.training.eval_pool import score_policies

    task = make_task(cfg.task, **cfg.task_config)
    eval_set = build_eval_set(task, cfg.set)
    cached = start / f"eval-{eval_set.fingerprint}-k{cfg.samples}.json"
    to_score = dict(policies)
    if not cached.is_file():
        to_score["\0start"] = start  # a name no caller's policy can have
    parts = [] if cached.is_file() else ["the start policy"]
    only = next(iter(policies))
    parts.append(f"the {only} policy" if len(policies) == 1 else f"{len(policies)} policies")
    notice(f"evaluating {' and '.join(parts)} on {len(eval_set)} held-out problems")
    scores = score_policies(
        to_score, cfg.task, cfg.task_config, cfg.set, cfg.samples, workers=cfg.workers
    )
    if cached.is_file():
        start_scores = json.loads(cached.read_text())
    else:
        start_scores = scores.pop("\0start")
        with contextlib.suppress(OSError):  # a read-only model directory: no cache
            cached.write_text(json.dumps(start_scores) + "\n")
    return {name: _compared(cfg, eval_set, start, start_scores, scores[name]) for name in policies}


def _compared(
    cfg: EvalConfig,
    eval_set: Any,
    start_policy: Path,
    start: dict[str, list[float]],
    final: dict[str, list[float]],
) -> Scored:
    from dora.training.evaluate import compare_scores, summarize_scores

    before = summarize_scores(eval_set, start)
    after = summarize_scores(eval_set, final)
    gain = compare_scores(eval_set, start, final)
    flat: dict[str, Any] = {}
    for metric in gain:
        if not isinstance(gain[metric], dict):
            continue
        name = "accuracy" if metric == "greedy" else metric
        flat[f"start_{name}"] = before[metric]["mean"]
        flat[f"final_{name}"] = after[metric]["mean"]
        flat[f"gain_{name}"] = gain[metric]["mean"]
        flat[f"gain_{name}_se"] = gain[metric]["se"]
    summary = {
        **flat,
        "start_policy": str(start_policy),
        "eval_set": {
            "split": cfg.set.split,
            "n": len(eval_set),
            "strata": eval_set.stratum_sizes(),
            "fingerprint": eval_set.fingerprint,
        },
        "start": before,
        "final": after,
        "gain": gain,
    }
    return Scored(
        summary=summary, scores={"strata": eval_set.strata, "start": start, "final": final}
    )
