"""The rollout stage: a fleet of built-in engines behind the dispatcher and the orchestrator.

The whole rollout in one stage (one process), for small pipelines and tests; a pipeline that
lists ``dispatcher``, ``generator`` (with replicas) and ``orchestrator`` runs the same
services as separate stages, each of which can have its own process.

A service stage (a source that publishes through its own components): ``setup`` starts the
engines, the dispatcher and the mode's version controller, ``teardown`` stops them. Engines
load version 0 from the run's model directory and later versions from the learner's
``WeightVersion`` blobs, verified by checksum.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from dora.events import Event, SamplingParams
from dora.rollout.generator_config import RolloutMode
from dora.stage import Context, Stage
from dora.stages.generator import check_fields
from dora.stages.model_source import ModelSource
from dora.subjects import DISPATCHER_KEY, LEDGER_KEY


class RolloutConfig(BaseModel):
    """Fleet size, mode, GRPO grouping, staleness bound, sampling, engine sizing."""

    model_config = ConfigDict(extra="forbid")

    model: ModelSource
    engines: int = Field(default=2, ge=1)
    mode: RolloutMode = "dora"
    group_size: int = Field(default=8, ge=1, description="G: samples per prompt.")
    batch_groups: int = Field(default=8, ge=1, description="B: groups per learner step.")
    staleness_bound: int = Field(default=2, ge=0, description="K.")
    temperature: float = Field(default=1.0, ge=0.0)
    max_tokens: int = Field(default=256, ge=1)
    seed: int = 0
    max_running: int = Field(default=32, ge=1, description="Requests one engine holds.")
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="EngineConfig fields.",
        json_schema_extra={"fields": "dora.engines.torch.config:EngineConfig"},
    )
    orchestrator: dict[str, Any] = Field(
        default_factory=dict,
        description="OrchestratorConfig fields (dora mode).",
        json_schema_extra={"fields": "dora.rollout.orchestrator:OrchestratorConfig"},
    )
    torch_threads: int | None = Field(default=1, ge=1, description="Intra-op threads per op.")

    @field_validator("engine", "orchestrator")
    @classmethod
    def _known_fields(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """Checked at load, so a misspelt field fails before a server or a warm start runs."""
        from dora.engines.torch import EngineConfig
        from dora.rollout.orchestrator import OrchestratorConfig

        target = EngineConfig if info.field_name == "engine" else OrchestratorConfig
        return check_fields(target, value, str(info.field_name))


class RolloutStage(Stage):
    """Runs a ``RolloutFleet`` of ``TorchEngine``s for the whole run."""

    name = "rollout"
    Config = RolloutConfig
    # dispatcher (requests), generators (trajectories, status, migrations), orchestrator and
    # migrator (control); the dispatcher keeps its ledger and state in the KV store
    publishes = ("requests", "trajectories", "status", "control", "rpc", "migrations")
    kv_writes = (LEDGER_KEY, DISPATCHER_KEY)

    async def setup(self, ctx: Context) -> None:
        import torch

        from dora.engines.torch import EngineConfig, TorchEngine
        from dora.learner.weights import WeightFetcher
        from dora.models import load_tokenizer
        from dora.rollout.dispatcher import DispatcherConfig
        from dora.rollout.fleet import FleetConfig, RolloutFleet
        from dora.rollout.generator_config import GeneratorConfig
        from dora.rollout.orchestrator import OrchestratorConfig
        from dora.rollout.orchestrator_service import OrchestratorServiceConfig

        cfg: RolloutConfig = self.config
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        directory = await asyncio.to_thread(cfg.model.resolve)
        tokenizer = load_tokenizer(directory)
        engine_config = EngineConfig(**cfg.engine)
        engines = [
            await asyncio.to_thread(
                TorchEngine.from_pretrained, directory, engine_config, f"engine-{i}", 0
            )
            for i in range(cfg.engines)
        ]
        fetcher = WeightFetcher(ctx.bus)
        fleet_config = FleetConfig(
            mode=cfg.mode,
            dispatcher=DispatcherConfig(
                group_size=cfg.group_size,
                batch_groups=cfg.batch_groups,
                staleness_bound=cfg.staleness_bound,
                seed=cfg.seed,
                max_prompt_tokens=min(e.max_model_len for e in engines) - 1,
                sampling=SamplingParams(
                    temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=0
                ),
            ),
            generator=GeneratorConfig(engine_id="_", max_running=cfg.max_running),
            orchestrator=OrchestratorServiceConfig(policy=OrchestratorConfig(**cfg.orchestrator)),
        )
        self.fleet = RolloutFleet(
            ctx.bus,
            engines,
            fetcher.fetch,
            fleet_config,
            tokenize=lambda text: tokenizer.encode(text, add_bos=True),
        )
        await self.fleet.start()
        ctx.log.info("rollout_started", engines=cfg.engines, mode=cfg.mode, model=str(directory))

    async def produce(self, ctx: Context) -> AsyncIterator[Event]:
        await asyncio.Event().wait()  # runs until the pipeline stops it
        yield  # pragma: no cover - makes this an async generator

    async def teardown(self, ctx: Context) -> None:
        await self.fleet.stop()

    def progress_done(self) -> int | None:
        fleet = getattr(self, "fleet", None)
        return None if fleet is None else sum(g.stats.finished for g in fleet.generators)

    def summary(self) -> dict[str, Any]:
        fleet = getattr(self, "fleet", None)
        if fleet is None:
            return {}
        return {
            "dispatched_requests": fleet.dispatch.stats.requests,
            "finished": sum(g.stats.finished for g in fleet.generators),
            "migrations_in": sum(g.stats.imported for g in fleet.generators),
            "reprefilled_tokens": sum(g.stats.reprefilled_tokens for g in fleet.generators),
            "resubmitted": sum(g.stats.resubmitted for g in fleet.generators),
        }
