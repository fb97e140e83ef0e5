"""The orchestrator stage: decides which version each engine serves.

In dora mode it is the ``OrchestratorService`` (with its migrator: consolidating old
versions' requests onto fewer engines by moving them with their KV cache); in the baseline
modes (``sync``, ``one_step_off``, ``partial``) the ``BaselineController``. Both reach the
engines only through ``control.<engine>`` requests and their status events.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from dora.rollout.generator_config import RolloutMode
from dora.stage import Context
from dora.stages.generator import check_fields
from dora.stages.service import ServiceStage


class OrchestratorStageConfig(BaseModel):
    """The rollout mode and the dora-mode policy."""

    model_config = ConfigDict(extra="forbid")

    mode: RolloutMode = "dora"
    orchestrator: dict[str, Any] = Field(
        default_factory=dict,
        description="OrchestratorConfig fields (dora mode).",
        json_schema_extra={"fields": "dora.rollout.orchestrator:OrchestratorConfig"},
    )
    tick_s: float | None = Field(
        default=None,
        gt=0,
        description="How often it plans; default: the controller's own (0.25 s dora, 0.1 s "
        "baselines).",
    )
    engine_timeout_s: float = Field(
        default=5.0, gt=0, description="An engine silent this long is gone."
    )

    @field_validator("orchestrator")
    @classmethod
    def _policy_fields(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        from dora.rollout.orchestrator import OrchestratorConfig

        return check_fields(OrchestratorConfig, value, str(info.field_name))


class OrchestratorStage(ServiceStage):
    """The mode's version controller (one replica)."""

    name = "orchestrator"
    Config = OrchestratorStageConfig
    publishes = ("control", "migrations")  # commands to engines, migration records

    async def setup(self, ctx: Context) -> None:
        from dora.rollout.baseline_controller import BaselineController
        from dora.rollout.orchestrator import OrchestratorConfig
        from dora.rollout.orchestrator_service import (
            OrchestratorService,
            OrchestratorServiceConfig,
        )

        cfg: OrchestratorStageConfig = self.config
        tick = {} if cfg.tick_s is None else {"tick_s": cfg.tick_s}
        self.controller: OrchestratorService | BaselineController
        if cfg.mode == "dora":
            self.controller = OrchestratorService(
                ctx.bus,
                OrchestratorServiceConfig(
                    **tick,
                    engine_timeout_s=cfg.engine_timeout_s,
                    policy=OrchestratorConfig(**cfg.orchestrator),
                ),
            )
        else:
            self.controller = BaselineController(
                ctx.bus, cfg.mode, engine_timeout_s=cfg.engine_timeout_s, **tick
            )
        self.services.start("controller", self.controller.run(), self.controller.stop)

    def _counts(self) -> dict[str, int]:
        """Commands sent: version assignments and (dora mode) migration orders, and how many
        requests moved (an order moves several; a request may finish before it is moved)."""
        from dora.rollout.actions import AssignEngine, MigrateRequests

        controller = getattr(self, "controller", None)
        if controller is None:
            return {}
        if not hasattr(controller, "actions"):  # the baseline controller
            return {"assignments": len(controller.assignments)}
        actions = [action for _, action in controller.actions]
        outcomes = controller.migrator.outcomes
        return {
            "assignments": sum(isinstance(a, AssignEngine) for a in actions),
            "migration_orders": sum(isinstance(a, MigrateRequests) for a in actions),
            "requests_migrated": sum(o.ok for o in outcomes),
            "migrations_refused": sum(not o.ok for o in outcomes),
        }

    def progress_done(self) -> int | None:
        counts = self._counts()
        return sum(counts.values()) if counts else None

    def summary(self) -> dict[str, Any]:
        return self._counts()
