"""Frozen, de-duplicated, difficulty-stratified evaluation sets.

An accuracy figure is only as good as the set behind it. A set drawn with replacement from a
task's natural distribution repeats its easy problems (a handful of two-term sums carried a
third of the old quickstart eval's weight), and a problem whose permutation was trained on is
not held out. So an eval set here is:

- drawn from the held-out split (``eval`` for claims, ``dev`` for tuning), which the task
  assigns by problem *identity* (a permutation of a training problem is the same problem);
- de-duplicated by that identity: every problem counts once, so a standard error over
  problems is the standard error clustered by problem;
- stratified by difficulty (a fixed number of problems per stratum, where that many distinct
  held-out problems exist), so the pooled figure is not one easy stratum in disguise;
- frozen: a pure function of the task config and the spec, with a fingerprint (the sha256 of
  the problems' identities, texts and answers in order) written next to every result, so two
  results can be checked to come from the same set.

Tasks that can draw a problem of a given size (``prompt_with_terms``) are stratified by it
and de-duplicated by their ``identity``; any other task gives one stratum of distinct prompt
texts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dora.events import Prompt
from dora.tasks.base import Task

DEFAULT_STRATA: tuple[tuple[int, int], ...] = ((2, 3), (4, 6), (7, 10), (11, 16))
"""Term-count strata of the arithmetic eval: every length the policy can learn to get right."""


class EvalSetSpec(BaseModel):
    """Which problems an eval set holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    split: Literal["eval", "dev"] = "eval"
    strata: tuple[tuple[int, int], ...] = DEFAULT_STRATA
    """Inclusive difficulty ranges (for arithmetic: number of terms)."""
    per_stratum: int | tuple[int, ...] = Field(
        default=330,
        description="Distinct problems per stratum: one count for all, or one per stratum (a "
        "stratum of long problems costs more to score, and its problems are more alike).",
    )
    attempts_per_problem: int = Field(
        default=20,
        ge=1,
        description="Draws per wanted problem before a stratum is declared exhausted (a stratum "
        "of short problems has few distinct held-out members).",
    )

    @model_validator(mode="after")
    def _strata(self) -> EvalSetSpec:
        for lo, hi in self.strata:
            if not 1 <= lo <= hi:
                raise ValueError(f"stratum ({lo}, {hi}) must satisfy 1 <= low <= high")
        counts = self.counts()
        if len(counts) != len(self.strata) or min(counts, default=0) < 0:
            raise ValueError(
                f"per_stratum must be one count >= 0 or one per stratum ({len(self.strata)}), "
                f"got {self.per_stratum}"
            )
        return self

    def counts(self) -> tuple[int, ...]:
        """Wanted problems of each stratum, in order."""
        if isinstance(self.per_stratum, int):
            return (self.per_stratum,) * len(self.strata)
        return self.per_stratum


@dataclass(frozen=True)
class EvalSet:
    """Distinct held-out problems with their stratum labels and the set's fingerprint."""

    prompts: tuple[Prompt, ...]
    strata: tuple[str, ...]
    fingerprint: str

    def __len__(self) -> int:
        return len(self.prompts)

    def stratum_sizes(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for label in self.strata:
            sizes[label] = sizes.get(label, 0) + 1
        return sizes


def stratum_label(low: int, high: int) -> str:
    return f"{low}-{high}" if low != high else str(low)


def _identity(task: Task, prompt: Prompt) -> str:
    own = getattr(task, "identity", None)
    return own(prompt) if own is not None else prompt.text


def build_eval_set(task: Task, spec: EvalSetSpec | None = None) -> EvalSet:
    """The frozen eval set of ``task`` under ``spec`` (same inputs, same set, anywhere)."""
    spec = spec or EvalSetSpec()
    seen: set[str] = set()
    prompts: list[Prompt] = []
    labels: list[str] = []
    stratified = hasattr(task, "prompt_with_terms")
    groups = spec.strata if stratified else ((0, 0),)
    counts = spec.counts() if stratified else (spec.counts()[0],)
    for (low, high), wanted in zip(groups, counts, strict=True):
        label = stratum_label(low, high) if stratified else "all"
        sizes = list(range(low, high + 1))
        taken = 0
        for i in range(wanted * spec.attempts_per_problem):
            if taken == wanted or not sizes:
                break
            if stratified:
                n = sizes[i % len(sizes)]
                try:
                    prompt = task.prompt_with_terms(spec.split, n, i)  # type: ignore[attr-defined]
                except LookupError:  # the split holds (almost) no problem of this size
                    sizes.remove(n)
                    continue
            else:
                prompt = task.prompt(spec.split, i)
            key = _identity(task, prompt)
            if key in seen:
                continue
            seen.add(key)
            prompts.append(prompt)
            labels.append(label)
            taken += 1
    lines = (f"{_identity(task, p)}\t{p.text}\t{p.answer}" for p in prompts)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    return EvalSet(tuple(prompts), tuple(labels), digest[:16])
