"""The learner stage: the GRPO learner service, then the held-out evaluation.

A finite service stage: it runs ``LearnerService`` until ``max_steps`` (the run is over when
the learner is), then saves the final policy as a HF checkpoint and scores it and the starting
policy on a frozen, de-duplicated, stratified eval set (``dora.tasks.evalset``): greedy and
avg@k, pooled and per stratum, with standard errors clustered by problem and the paired gain,
into ``<run_dir>/eval.json`` (per-problem scores in ``eval_scores.json``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dora.events import Event
from dora.stage import Context, Stage
from dora.stages.model_source import ModelSource
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


class LearnerStageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: ModelSource
    learner: dict[str, Any] = Field(
        default_factory=dict,
        description="LearnerConfig fields.",
        json_schema_extra={"fields": "dora.learner.config:LearnerConfig"},
    )
    eval: EvalConfig = Field(default_factory=EvalConfig)
    torch_threads: int | None = Field(default=None, ge=1)

    @field_validator("learner")
    @classmethod
    def _learner_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        """Checked at load, so a misspelt field fails before a server or a warm start runs."""
        from dora.learner.config import LearnerConfig

        try:
            LearnerConfig.from_dict(value)
        except TypeError as exc:
            raise ValueError(str(exc)) from exc
        return value


class LearnerStage(Stage):
    """Trains until ``learner.max_steps``; completes the run."""

    name = "learner"
    finite = True
    Config = LearnerStageConfig
    publishes = ("weights", "metrics")
    kv_writes = ("weights.>",)  # each version's record before it is announced, pruning

    async def setup(self, ctx: Context) -> None:
        import torch

        from dora.learner import LearnerConfig, LearnerService
        from dora.models import load_pretrained, load_tokenizer

        cfg: LearnerStageConfig = self.config
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.run_dir = Path(ctx.run_dir or Path("runs") / ctx.run_id)
        self.model_dir = await asyncio.to_thread(cfg.model.resolve)
        self.learner_config = LearnerConfig.from_dict(cfg.learner)
        model = load_pretrained(self.model_dir)
        # The KL term's reference is the start policy, frozen (loaded only when it is used).
        ref_model = (
            load_pretrained(self.model_dir).eval().requires_grad_(False)
            if self.learner_config.grpo.kl_coef > 0
            else None
        )
        self.tokenizer = load_tokenizer(self.model_dir)
        self.started = time.time()

        def on_step(step: int, batch: Any, metrics: dict[str, float]) -> None:
            ctx.stats.processed = step + 1
            ctx.log.info(
                "step",
                step=step,
                reward=round(metrics.get("reward/mean", 0.0), 3),
                staleness=metrics.get("staleness/mean"),
            )

        self.service = LearnerService(
            ctx.bus,
            model,
            self.learner_config,
            self.run_dir,
            tokenizer=self.tokenizer,
            on_step=on_step,
            ref_model=ref_model,
        )
        self.stop_event = asyncio.Event()
        self.task = asyncio.create_task(self.service.run(self.stop_event))
        await self.service.ready.wait()  # its durable consumer exists before `scored` flows

    async def produce(self, ctx: Context) -> AsyncIterator[Event]:
        await self.task  # training done: the run completes, upstream stages are stopped
        return
        yield  # pragma: no cover - makes this an async generator

    def _finish(self, ctx: Context) -> None:
        from dora.models import save_pretrained

        final = self.run_dir / "final"
        save_pretrained(self.service.model, final, self.tokenizer)
        result: dict[str, Any] = {
            "steps": self.service.step,
            "train_seconds": time.time() - self.started,
        }
        if sum(self.config.eval.set.counts()):
            result.update(self._evaluate(final))
        (self.run_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
        headline = {k: v for k, v in result.items() if isinstance(v, int | float)}
        ctx.log.info("evaluated", **{k: round(v, 4) for k, v in headline.items()})
        self.result = headline

    def _evaluate(self, final: Path) -> dict[str, Any]:
        """Start and final policy on the frozen eval set: pooled and per-stratum means with
        standard errors clustered by problem, and the paired gain. Per-problem scores go to
        ``eval_scores.json`` (to pool seeds or re-analyse without re-running)."""
        from dora.logs import notice
        from dora.tasks import make_task
        from dora.tasks.evalset import build_eval_set
        from dora.training.eval_pool import score_policies
        from dora.training.evaluate import compare_scores, summarize_scores

        cfg: EvalConfig = self.config.eval
        task = make_task(cfg.task, **cfg.task_config)
        eval_set = build_eval_set(task, cfg.set)

        # The start policy's scores are a pure function of its weights and the frozen set:
        # kept beside the weights, so a run from a cached warm start does not pay for them.
        cached = self.model_dir / f"eval-{eval_set.fingerprint}-k{cfg.samples}.json"
        which = "the final policy" if cached.is_file() else "the start and final policies"
        notice(f"evaluating {which} on {len(eval_set.prompts)} held-out problems")
        policies = {"final": final}
        if not cached.is_file():
            policies = {"start": self.model_dir, **policies}
        scores = score_policies(
            policies, cfg.task, cfg.task_config, cfg.set, cfg.samples, workers=cfg.workers
        )
        if cached.is_file():
            scores["start"] = json.loads(cached.read_text())
        else:
            with contextlib.suppress(OSError):  # a read-only model directory: no cache
                cached.write_text(json.dumps(scores["start"]) + "\n")
        scores = {"start": scores["start"], "final": scores["final"]}
        start = summarize_scores(eval_set, scores["start"])
        end = summarize_scores(eval_set, scores["final"])
        gain = compare_scores(eval_set, scores["start"], scores["final"])
        (self.run_dir / "eval_scores.json").write_text(
            json.dumps({"strata": eval_set.strata, **scores}) + "\n"
        )
        flat: dict[str, Any] = {}
        for metric in gain:
            if not isinstance(gain[metric], dict):
                continue
            name = "accuracy" if metric == "greedy" else metric
            flat[f"start_{name}"] = start[metric]["mean"]
            flat[f"final_{name}"] = end[metric]["mean"]
            flat[f"gain_{name}"] = gain[metric]["mean"]
            flat[f"gain_{name}_se"] = gain[metric]["se"]
        sizes = eval_set.stratum_sizes()
        return {
            **flat,
            "eval_set": {
                "split": cfg.set.split,
                "n": len(eval_set),
                "strata": sizes,
                "fingerprint": eval_set.fingerprint,
            },
            "start": start,
            "final": end,
            "gain": gain,
        }

    async def teardown(self, ctx: Context) -> None:
        """Runs after the rollout stopped (the pipeline stops upstream first): the evaluation
        then has the CPU to itself."""
        if not self.task.done():
            self.stop_event.set()
            await asyncio.gather(self.task, return_exceptions=True)
        service = getattr(self, "service", None)
        close = getattr(service.publisher.transport, "close", None) if service else None
        if close is not None:  # the broadcast server's thread and port
            await asyncio.to_thread(close)
        if not self.task.cancelled() and self.task.exception() is None:
            await asyncio.to_thread(self._finish, ctx)

    def progress_done(self) -> int | None:
        """Steps taken, a resumed run's earlier ones included."""
        service = getattr(self, "service", None)
        return None if service is None else service.step

    def progress_total(self) -> int | None:
        steps = self.config.learner.get("max_steps")
        return int(steps) if steps is not None else None

    def summary(self) -> dict[str, Any]:
        return dict(getattr(self, "result", {}))
