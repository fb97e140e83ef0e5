"""Accuracy of a model on a task's eval split, using the reference generator.

Two numbers matter for RL: greedy accuracy (how good the start is) and, for groups of samples
at temperature 1, how many groups are mixed (some right, some wrong) — only those give GRPO a
non-zero advantage.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from dora import interrupt
from dora.events import Prompt
from dora.models.generate import generate
from dora.models.llama import LlamaModel
from dora.models.tokenizer import CharTokenizer
from dora.rewards import RewardService
from dora.tasks import Task
from dora.tasks.evalset import EvalSet


def _max_new_tokens(task: Task, tokenizer: CharTokenizer, prompts: list[Prompt]) -> int:
    longest = max(len(tokenizer.encode(task.solve(p))) for p in prompts)
    return int(longest * 1.25) + 16


def _score(task: Task, prompts: list[Prompt], texts: list[str]) -> list[bool]:
    service = RewardService(use_processes=False)
    try:
        return [
            service.verifier_for(p.task).verify(t, p).correct
            for p, t in zip(prompts, texts, strict=True)
        ]
    finally:
        service.close()


def complete(
    model: LlamaModel,
    tokenizer: CharTokenizer,
    task: Task,
    prompts: list[Prompt],
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 64,
) -> list[str]:
    """Completion texts of prompts, batched by similar expected length."""
    if not prompts:
        return []
    order = sorted(range(len(prompts)), key=lambda i: len(task.solve(prompts[i])))
    texts: list[str] = [""] * len(prompts)
    for b in range(0, len(order), batch_size):
        interrupt.check()  # an evaluation of long answers takes minutes: Ctrl-C between batches
        chunk = [prompts[i] for i in order[b : b + batch_size]]
        ids = [tokenizer.encode(p.text, add_bos=True) for p in chunk]
        outs = generate(
            model,
            tokenizer,
            ids,
            _max_new_tokens(task, tokenizer, chunk),
            temperature=temperature,
            seed=seed + b,
        )
        for i, out in zip(order[b : b + batch_size], outs, strict=True):
            texts[i] = tokenizer.decode(out)
    return texts


def evaluate_task(
    model: LlamaModel,
    tokenizer: CharTokenizer,
    task: Task,
    eval_prompts: int = 128,
    group_prompts: int = 16,
    group_size: int = 8,
    seed: int = 0,
    samples: int = 0,
) -> dict[str, Any]:
    """Greedy accuracy (overall and by problem size), group-of-``group_size`` statistics and,
    with ``samples`` > 0, the mean accuracy of that many temperature-1 samples per prompt
    (avg@k: what the policy does when it samples, as in RL papers' avg@32)."""
    result: dict[str, Any] = {}
    prompts = list(task.prompts("eval", eval_prompts))
    if prompts:
        texts = complete(model, tokenizer, task, prompts)
        correct = _score(task, prompts, texts)
        result["accuracy"] = float(np.mean(correct))
        result["n"] = len(prompts)
        result["mean_length"] = float(np.mean([len(tokenizer.encode(t)) for t in texts]))
        sizes = [len(tokenizer.encode(task.solve(p))) for p in prompts]
        edges = [0, 32, 64, 128, 256, 10**9]
        for lo, hi in itertools.pairwise(edges):
            picked = [c for c, s in zip(correct, sizes, strict=True) if lo <= s < hi]
            if picked:
                result[f"accuracy_len_{lo}_{hi if hi < 10**9 else 'inf'}"] = float(np.mean(picked))
    if prompts and samples:
        repeated = [p for p in prompts for _ in range(samples)]
        texts = complete(model, tokenizer, task, repeated, temperature=1.0, seed=seed + 2)
        result["sampled_accuracy"] = float(np.mean(_score(task, repeated, texts)))
        result["sampled_mean_length"] = float(np.mean([len(tokenizer.encode(t)) for t in texts]))
    if group_prompts:
        base = list(task.prompts("eval", group_prompts))
        repeated = [p for p in base for _ in range(group_size)]
        texts = complete(model, tokenizer, task, repeated, temperature=1.0, seed=seed + 1)
        ok = np.array(_score(task, repeated, texts)).reshape(group_prompts, group_size)
        per_group = ok.mean(1)
        result["sample_accuracy_t1"] = float(ok.mean())
        result["groups_mixed"] = float(np.mean((per_group > 0) & (per_group < 1)))
        result["groups_all_wrong"] = float(np.mean(per_group == 0))
        result["groups_all_right"] = float(np.mean(per_group == 1))
    return result


def clustered_mean(per_problem: np.ndarray) -> tuple[float, float]:
    """Mean over problems and its standard error clustered by problem.

    ``per_problem`` holds one value per problem (its accuracy over its k samples): samples of
    one problem are correlated, so the problem is the unit of the standard error, not the
    sample. With k = 1 this is the binomial standard error over distinct problems.
    """
    n = len(per_problem)
    if n == 0:
        return float("nan"), float("nan")
    se = float(per_problem.std(ddof=1) / np.sqrt(n)) if n > 1 else float("nan")
    return float(per_problem.mean()), se


def score_eval_set(
    model: LlamaModel,
    tokenizer: CharTokenizer,
    task: Task,
    eval_set: EvalSet,
    samples: int = 0,
    seed: int = 0,
) -> dict[str, list[float]]:
    """Per-problem scores on a frozen eval set: greedy correctness and, with ``samples`` > 0,
    the share of that many temperature-1 samples that are right (avg@k)."""
    prompts = list(eval_set.prompts)
    texts = complete(model, tokenizer, task, prompts)
    out = {
        "greedy": [float(c) for c in _score(task, prompts, texts)],
        "greedy_length": [float(len(tokenizer.encode(t))) for t in texts],
    }
    if samples:
        repeated = [p for p in prompts for _ in range(samples)]
        texts = complete(model, tokenizer, task, repeated, temperature=1.0, seed=seed + 2)
        ok = np.array(_score(task, repeated, texts), dtype=float).reshape(len(prompts), samples)
        out[f"avg@{samples}"] = [float(x) for x in ok.mean(1)]
    return out


def summarize_scores(eval_set: EvalSet, scores: dict[str, list[float]]) -> dict[str, Any]:
    """Pooled and per-stratum mean ± clustered SE of every per-problem metric."""
    labels = np.array(eval_set.strata)
    out: dict[str, Any] = {"n": len(eval_set), "fingerprint": eval_set.fingerprint}
    for metric, values in scores.items():
        arr = np.asarray(values, dtype=float)
        mean, se = clustered_mean(arr)
        strata = {}
        for label in dict.fromkeys(eval_set.strata):
            m, s = clustered_mean(arr[labels == label])
            strata[label] = {"mean": m, "se": s, "n": int((labels == label).sum())}
        out[metric] = {"mean": mean, "se": se, "strata": strata}
    return out


def compare_scores(
    eval_set: EvalSet, start: dict[str, list[float]], final: dict[str, list[float]]
) -> dict[str, Any]:
    """final - start per metric, pooled and per stratum, with the SE of the paired per-problem
    differences (the same problems before and after: pairing removes their difficulty)."""
    diffs = {
        metric: [b - a for a, b in zip(start[metric], final[metric], strict=True)]
        for metric in start
        if metric in final and not metric.endswith("_length")
    }
    return summarize_scores(eval_set, diffs)
