"""The generator stage: one engine per replica, pulling its version's requests.

Each replica is a ``Generator`` (``dora.rollout.generator``) around an engine named
``engine-<replica>``: the built-in ``TorchEngine`` or, with ``engine_kind: vllm`` (extra
``vllm``), a ``VllmEngine`` (a list of kinds mixes them, one per replica). In one process
the stage hosts every replica; ``dora run --processes`` (or ``dora stage serve --replica I``)
gives each its own process. Version 0 comes from the run's model directory, later versions
from the learner's ``WeightVersion`` blobs, verified by checksum. The dispatcher, the
orchestrator and the other generators are reached only over the bus.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dora.rollout.episodes import EpisodeConfig
from dora.rollout.generator_config import RolloutMode
from dora.stage import Context
from dora.stages.model_source import ModelSource
from dora.stages.service import ServiceStage


def check_fields(target: type, value: dict[str, Any], field_name: str) -> dict[str, Any]:
    """A dataclass's fields checked at load, so a misspelt one fails before anything starts."""
    from dora.learner.config import build_dataclass

    try:
        build_dataclass(target, value, field_name)
    except TypeError as exc:
        raise ValueError(str(exc)) from exc
    return value


EngineKind = Literal["dora", "vllm"]


class GeneratorStageConfig(BaseModel):
    """The engine each replica runs and how many requests it holds."""

    model_config = ConfigDict(extra="forbid")

    model: ModelSource
    mode: RolloutMode = "dora"
    max_running: int = Field(default=32, ge=1, description="Requests one engine holds.")
    max_parked: int = Field(
        default=32,
        ge=0,
        description="Episodes: more requests held while that many wait on their environment "
        "(their KV stays; they take no decode slot).",
    )
    engine_kind: EngineKind | list[EngineKind] = Field(
        default="dora",
        description="'dora' (the built-in engine) or 'vllm' for every replica, or one kind "
        "per replica (a mixed fleet: requests migrate only between engines of one kind).",
    )
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="EngineConfig fields (built-in engines).",
        json_schema_extra={"fields": "dora.engines.torch.config:EngineConfig"},
    )
    vllm: dict[str, Any] = Field(
        default_factory=dict,
        description="VllmEngineConfig fields (vLLM engines).",
        json_schema_extra={"fields": "dora.engines.vllm.config:VllmEngineConfig"},
    )
    torch_threads: int | None = Field(default=1, ge=1, description="Intra-op threads per op.")
    status_interval_s: float = Field(
        default=0.5, gt=0, description="How often each engine publishes its status."
    )
    episodes: EpisodeConfig | None = Field(
        default=None,
        description="Every request is a multi-turn episode in this environment (served by "
        "an environment stage).",
    )
    export_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="A request exported for a migration that neither moved nor came back "
        "within this (the orchestrator died mid-migration) goes on generating here.",
    )

    @model_validator(mode="after")
    def _episodes_keep_one_version(self) -> GeneratorStageConfig:
        if self.episodes is not None and self.mode == "partial":
            raise ValueError(
                "episodes: the partial baseline re-serves interrupted requests under newer "
                "weights, so an episode would span versions; use mode dora, sync or one_step_off"
            )
        return self

    @model_validator(mode="after")
    def _vllm_serves_single_turns(self) -> GeneratorStageConfig:
        if self.episodes is not None and "vllm" in self.kinds(1):
            raise ValueError(
                "episodes: multi-turn episodes park requests between turns, which the vLLM "
                "engine does not do; use engine_kind: dora"
            )
        return self

    @field_validator("engine")
    @classmethod
    def _engine_fields(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        from dora.engines.torch import EngineConfig

        return check_fields(EngineConfig, value, str(info.field_name))

    @field_validator("vllm")
    @classmethod
    def _vllm_fields(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        from dora.engines.vllm.config import VllmEngineConfig

        return check_fields(VllmEngineConfig, value, str(info.field_name))

    def kinds(self, replicas: int) -> list[str]:
        """The engine kind of each replica (a list must name one per replica)."""
        if isinstance(self.engine_kind, str):
            return [self.engine_kind] * replicas
        return list(self.engine_kind)


class GeneratorStage(ServiceStage):
    """``replicas`` generators, one engine each (``engine-<replica>``)."""

    name = "generator"
    Config = GeneratorStageConfig
    hosts_replicas = True
    # trajectories, its status, migration records (the import side); replies to control
    # requests go to the caller's inbox
    publishes = ("trajectories", "status", "migrations", "env_steps")

    async def setup(self, ctx: Context) -> None:
        import torch

        from dora.engines.torch import EngineConfig, TorchEngine
        from dora.learner.weights import WeightFetcher
        from dora.rollout.generator import Generator
        from dora.rollout.generator_config import GeneratorConfig

        cfg: GeneratorStageConfig = self.config
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        directory = await asyncio.to_thread(cfg.model.resolve)
        engine_config = EngineConfig(**cfg.engine)
        fetch = WeightFetcher(ctx.bus).fetch
        self.generators: list[Generator] = []
        self.engines: list[Any] = []
        kinds = self._kinds()
        for replica in self.replica_ids:
            engine_id = f"engine-{replica}"
            if kinds[replica] == "vllm":
                engine = await asyncio.to_thread(self._vllm_engine, directory, engine_id)
            else:
                engine = await asyncio.to_thread(
                    TorchEngine.from_pretrained, directory, engine_config, engine_id, 0
                )
            self.engines.append(engine)
            generator = Generator(
                engine,
                ctx.bus,
                fetch,
                GeneratorConfig(
                    engine_id=engine.engine_id,
                    mode=cfg.mode,
                    max_running=cfg.max_running,
                    max_parked=cfg.max_parked if cfg.episodes is not None else 0,
                    export_timeout_s=cfg.export_timeout_s,
                    status_interval_s=cfg.status_interval_s,
                    initial_version=0,
                    episodes=cfg.episodes,
                ),
            )
            self.generators.append(generator)
            self.services.start(engine.engine_id, generator.run(), generator.stop)
        # ready: consuming its version's queue and announcing its status
        await self.services.until(g.ready for g in self.generators)
        ctx.log.info("generators_started", engines=[g.config.engine_id for g in self.generators])

    def _kinds(self) -> dict[int, str]:
        cfg: GeneratorStageConfig = self.config
        last = max(self.replica_ids, default=0)
        kinds = cfg.kinds(last + 1)
        if len(kinds) <= last:
            raise ValueError(
                f"generator.engine_kind lists {len(kinds)} kinds but replica {last} runs; name "
                "one kind per replica, or a single kind for all"
            )
        return {r: kinds[r] for r in self.replica_ids}

    def _vllm_engine(self, directory: Any, engine_id: str) -> Any:
        from dora.engines.vllm import vllm_missing

        missing = vllm_missing()
        if missing is not None:
            raise RuntimeError(f"generator.engine_kind vllm: {missing}")
        from dora.engines.vllm.config import VllmEngineConfig
        from dora.engines.vllm.engine import VllmEngine

        return VllmEngine(directory, VllmEngineConfig(**self.config.vllm), engine_id, 0)

    async def teardown(self, ctx: Context) -> None:
        await super().teardown(ctx)
        for engine in getattr(self, "engines", []):
            close = getattr(engine, "close", None)
            if close is not None:  # vLLM's engine core is a process of its own
                await asyncio.to_thread(close)

    def progress_done(self) -> int | None:
        generators = getattr(self, "generators", None)
        return None if generators is None else sum(g.stats.finished for g in generators)

    def summary(self) -> dict[str, Any]:
        generators = getattr(self, "generators", [])
        return {
            "finished": sum(g.stats.finished for g in generators),
            "migrations_in": sum(g.stats.imported for g in generators),
            "reprefilled_tokens": sum(g.stats.reprefilled_tokens for g in generators),
            "resubmitted": sum(g.stats.resubmitted for g in generators),
        }
