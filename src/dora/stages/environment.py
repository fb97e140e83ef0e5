"""The environment stage: replicas of one environment serving episodes' steps on the bus.

Each replica (``env-<replica>``) is an ``EnvironmentService`` around an ``EnvironmentHost``;
in one process the stage hosts every replica, ``dora run --processes`` gives each its own.
Generators reach it only through ``env_steps`` and ``env_replies`` (``dora.events.EnvStep``,
``EnvReply``), so an environment may equally be a service in another language that speaks
those JSON events (``schemas/``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dora.stage import Context
from dora.stages.service import ServiceStage


class EnvironmentStageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    environment: str = Field(description="A dora.envs environment name.")
    environment_config: dict[str, Any] = Field(default_factory=dict)
    step_timeout_s: float = Field(default=60.0, gt=0, description="One step's deadline.")
    episode_timeout_s: float = Field(default=600.0, gt=0, description="A whole episode's.")
    concurrency: int = Field(default=64, ge=1, description="Steps handled at once per replica.")

    @model_validator(mode="after")
    def _builds(self) -> EnvironmentStageConfig:
        from dora.envs import make_environment

        make_environment(self.environment, **self.environment_config)
        return self


class EnvironmentStage(ServiceStage):
    """``replicas`` environment hosts (see module docstring)."""

    name = "environment"
    Config = EnvironmentStageConfig
    hosts_replicas = True
    publishes = ("env_replies",)

    async def setup(self, ctx: Context) -> None:
        from dora.envs import make_environment
        from dora.envs.host import EnvironmentHost
        from dora.envs.service import EnvironmentService

        cfg: EnvironmentStageConfig = self.config
        self.hosts: list[EnvironmentHost] = []
        services = []
        for replica in self.replica_ids:
            host = EnvironmentHost(
                f"env-{replica}",
                cfg.environment,
                lambda: make_environment(cfg.environment, **cfg.environment_config),
                step_timeout_s=cfg.step_timeout_s,
                episode_timeout_s=cfg.episode_timeout_s,
            )
            service = EnvironmentService(host, ctx.bus, cfg.concurrency)
            self.hosts.append(host)
            services.append(service)
            self.services.start(host.owner, service.run(), service.stop)
        await self.services.until(s.ready for s in services)
        ctx.log.info("environments_started", replicas=[h.owner for h in self.hosts])

    def progress_done(self) -> int | None:
        hosts = getattr(self, "hosts", None)
        return None if hosts is None else sum(h.stats.episodes for h in hosts)

    def summary(self) -> dict[str, Any]:
        hosts = getattr(self, "hosts", [])
        return {
            "episodes": sum(h.stats.episodes for h in hosts),
            "steps": sum(h.stats.steps for h in hosts),
            "replayed_steps": sum(h.stats.replayed for h in hosts),
            "lost_episodes": sum(h.stats.lost for h in hosts),
            "failed_episodes": sum(h.stats.failed for h in hosts),
        }
