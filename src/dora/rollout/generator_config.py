"""What a generator is configured with, and the contracts it shares with other stages.

Kept apart from the engine loop so the orchestrator and the baseline controller can read the
request-queue definition (and the dispatcher-facing names) without importing the generator.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from dora.bus import ConsumerSpec
from dora.subjects import Subjects

if TYPE_CHECKING:
    from dora.rollout.episodes import EpisodeConfig

WeightSource = Callable[[int], Awaitable[Mapping[str, Any] | Path]]
"""Returns the weights of a version (state dict or checkpoint dir), verified."""

RolloutMode = Literal["dora", "sync", "one_step_off", "partial"]


def trajectory_event_id(request_id: str) -> str:
    """One id per request: a regenerated duplicate is dropped by the bus's dedupe."""
    return f"traj-{request_id}"


QUEUE_ACK_WAIT_S = 30.0
"""A held request whose engine stops heartbeating for this long is redelivered."""
QUEUE_MAX_DELIVER = 10


def request_queue_spec(
    subjects: Subjects, version: int, ack_wait_s: float = QUEUE_ACK_WAIT_S
) -> ConsumerSpec:
    """The durable consumer every engine of one version shares (a work queue).

    One definition for engines and the orchestrator (which reads its depth): JetStream
    refuses a second, different consumer on a work-queue subject.
    """
    return ConsumerSpec(
        f"gen-v{version}",
        subjects.requests(version),
        max_ack_pending=100_000,
        max_deliver=QUEUE_MAX_DELIVER,
        ack_wait_s=ack_wait_s,
    )


@dataclass
class GeneratorConfig:
    """How one generator pulls work and reports."""

    engine_id: str
    mode: RolloutMode = "dora"
    max_running: int = 32
    fetch_timeout_s: float = 0.5
    status_interval_s: float = 0.5
    heartbeat_interval_s: float = 5.0
    export_timeout_s: float = 120.0
    """An exported request neither released nor restored within this is restored here: the
    migrator died mid-protocol. Without it the request (and its KV) would be parked forever,
    its lease kept alive by our heartbeats. Keep it above the migrator's timeouts (import +
    release); a late import elsewhere only means a duplicate, dropped by trajectory dedupe."""
    queue_ack_wait_s: float = QUEUE_ACK_WAIT_S
    """Used when this generator is the first to create its version's queue consumer."""
    initial_version: int | None = None
    max_parked: int = 0
    """Episodes parked on their environment (beyond ``max_running``) before the pull stops."""
    episodes: EpisodeConfig | None = None
    """Every request is a multi-turn episode in this environment (``dora.rollout.episodes``)."""


@dataclass
class GeneratorStats:
    """Counters for tests and reports."""

    pulled: int = 0
    finished: int = 0
    exported: int = 0
    imported: int = 0
    restored: int = 0
    resubmitted: int = 0
    reprefilled_tokens: int = 0
    """Prompt and generated tokens recomputed for finished trajectories (0 under dora)."""
    dead_lettered: int = 0
    rebound: int = 0
    """Requests redelivered while still generating here (a lapsed lease): kept, not re-run."""
    weight_loads: list[tuple[int, float]] = field(default_factory=list)
