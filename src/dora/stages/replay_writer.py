"""The replay writer: copies a fan-out family (trajectories, scored) into ``replay.<family>``,
a limits-retention stream bounded by age and size, so a service that joins late or restarts
can read the run from its start with a durable consumer of its own.

Why a stage rather than a JetStream mirror: a mirror of an interest stream reads through an
unacked ephemeral consumer and can miss messages the other consumers already acked (NATS
ADR-60). The writer is an ordinary durable consumer: the interest stream keeps each message
until the copy is stored, and the copy keeps the event id, so a redelivery is deduplicated.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dora.bus.base import ReplayLimits
from dora.contract import FAMILY_EVENTS
from dora.events import Event
from dora.stage import Context, Stage

ReplayedFamily = Literal["trajectories", "scored"]


class ReplaySettings(BaseModel):
    """YAML ``replay:`` / ``Pipeline(replay=...)``: which families to copy, for how long."""

    model_config = ConfigDict(extra="forbid")

    families: list[ReplayedFamily] = Field(
        default_factory=lambda: ["trajectories", "scored"], min_length=1
    )
    max_age_s: float = Field(default=ReplayLimits.max_age_s, gt=0)
    max_bytes: int = Field(default=-1, ge=-1, description="-1: no size limit")

    @property
    def limits(self) -> ReplayLimits:
        return ReplayLimits(max_age_s=self.max_age_s, max_bytes=self.max_bytes)

    def writers(self) -> list[ReplayWriter]:
        return [ReplayWriter(family=family) for family in dict.fromkeys(self.families)]


class ReplayWriterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    family: ReplayedFamily = "trajectories"


class ReplayWriter(Stage):
    """One per replayed family; added by ``Pipeline(replay=...)`` (YAML ``replay:``)."""

    Config = ReplayWriterConfig
    concurrency = 64

    def __init__(self, *, family: str = "trajectories", **kwargs: Any) -> None:
        kwargs.pop("consumes", None)  # always its family (``clone`` passes it back)
        kwargs["name"] = kwargs.get("name") or f"replay-{family}"
        event = FAMILY_EVENTS.get(family, Event)
        self.input_model = event  # type: ignore[misc]
        self.emits = {event: f"replay.{family}"}  # type: ignore[misc]
        super().__init__(consumes=family, family=family, **kwargs)

    async def handle(self, event: Event, ctx: Context) -> Event:
        return event  # same event id: the replay stream drops a redelivered copy
