"""The learner stage: the GRPO learner service, then the held-out evaluation.

A finite service stage: it runs ``LearnerService`` until ``max_steps`` (the run is over when
the learner is), then saves the final policy as a HF checkpoint and measures greedy accuracy
on the task's eval split next to the starting policy's, into ``<run_dir>/eval.json``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dora.events import Event
from dora.stage import Context, Stage
from dora.stages.model_source import ModelSource


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str = "arithmetic"
    task_config: dict[str, Any] = Field(default_factory=dict)
    prompts: int = Field(default=128, ge=0, description="Held-out prompts (0: no evaluation).")
    samples: int = Field(
        default=4, ge=0, description="Temperature-1 samples per prompt for avg@k (0: greedy only)."
    )


class LearnerStageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: ModelSource
    learner: dict[str, Any] = Field(default_factory=dict, description="LearnerConfig fields.")
    eval: EvalConfig = Field(default_factory=EvalConfig)
    torch_threads: int | None = Field(default=None, ge=1)


class LearnerStage(Stage):
    """Trains until ``learner.max_steps``; completes the run."""

    name = "learner"
    finite = True
    Config = LearnerStageConfig

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
        )
        self.stop_event = asyncio.Event()
        self.task = asyncio.create_task(self.service.run(self.stop_event))
        await self.service.ready.wait()  # its durable consumer exists before `scored` flows

    async def produce(self, ctx: Context) -> AsyncIterator[Event]:
        await self.task  # training done: the run completes, upstream stages are stopped
        return
        yield  # pragma: no cover - makes this an async generator

    def _finish(self, ctx: Context) -> None:
        from dora.models import load_pretrained, save_pretrained
        from dora.models.evaluate import evaluate_task
        from dora.tasks import make_task

        final = self.run_dir / "final"
        save_pretrained(self.service.model, final, self.tokenizer)
        cfg: LearnerStageConfig = self.config
        result: dict[str, Any] = {
            "steps": self.service.step,
            "train_seconds": time.time() - self.started,
        }
        if cfg.eval.prompts:
            task = make_task(cfg.eval.task, **cfg.eval.task_config)
            for name, directory in (("start", self.model_dir), ("final", final)):
                model = load_pretrained(directory)
                scores = evaluate_task(
                    model,
                    self.tokenizer,
                    task,
                    eval_prompts=cfg.eval.prompts,
                    group_prompts=0,
                    samples=cfg.eval.samples,
                )
                for key in ("accuracy", "sampled_accuracy", "mean_length", "sampled_mean_length"):
                    if key in scores:
                        result[f"{name}_{key}"] = scores[key]
            result["gain"] = result["final_accuracy"] - result["start_accuracy"]
            if cfg.eval.samples:
                result["sampled_gain"] = (
                    result["final_sampled_accuracy"] - result["start_sampled_accuracy"]
                )
        (self.run_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
        ctx.log.info("evaluated", **{k: round(v, 4) for k, v in result.items()})
        self.result = result

    async def teardown(self, ctx: Context) -> None:
        """Runs after the rollout stopped (the pipeline stops upstream first): the evaluation
        then has the CPU to itself."""
        if not self.task.done():
            self.stop_event.set()
            await asyncio.gather(self.task, return_exceptions=True)
        if not self.task.cancelled() and self.task.exception() is None:
            await asyncio.to_thread(self._finish, ctx)

    def progress_total(self) -> int | None:
        steps = self.config.learner.get("max_steps")
        return int(steps) if steps is not None else None

    def summary(self) -> dict[str, Any]:
        return dict(getattr(self, "result", {}))
