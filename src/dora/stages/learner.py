"""The learner stage: the GRPO learner service, then the held-out evaluation.

A finite service stage: it runs ``LearnerService`` until ``max_steps`` (the run is over when
the learner is), then saves the final policy as a HF checkpoint and scores it and the starting
policy on a frozen, de-duplicated, stratified eval set (``dora.tasks.evalset``): greedy and
avg@k, pooled and per stratum, with standard errors clustered by problem and the paired gain,
into ``<run_dir>/eval.json`` (per-problem scores in ``eval_scores.json``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dora.events import Event
from dora.stage import Context, Stage
from dora.stages.model_source import ModelSource
from dora.training.heldout import EvalConfig


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
        """Start and final policy on the frozen eval set (``dora.training.heldout``);
        per-problem scores go to ``eval_scores.json``."""
        from dora.training.heldout import score_against_start

        scored = score_against_start(self.config.eval, self.model_dir, {"final": final})["final"]
        (self.run_dir / "eval_scores.json").write_text(json.dumps(scored.scores) + "\n")
        return scored.summary

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
