"""The orchestrator's view of the fleet: pure, immutable data for ``plan(state, config)``.

The live service builds a ``ClusterState`` from ``EngineStatus`` events, queue depths and the
staleness ledger; the simulator builds it from its own model. Nothing here does I/O or reads a
clock: ``ClusterState.now`` carries time, so the policy is a deterministic function.

Vocabulary used by the policy:

- an engine's *loaded* version (``version``) is the weights it holds; its *assigned* version
  is what the orchestrator told it to serve. They differ while it loads, or while it finishes
  requests of the loaded version before loading the assigned one (engines never mix versions).
- an engine *pulls* version ``v`` (takes requests from ``requests.v<v>``) when it is serving or
  loading and assigned ``v``; a draining, idle or stopped engine pulls nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from dora.events import EngineStatus
from dora.rollout.estimates import LengthModel

EngineState = Literal["idle", "loading", "serving", "draining", "stopped"]
ENGINE_STATES: frozenset[str] = frozenset({"idle", "loading", "serving", "draining", "stopped"})


@dataclass(frozen=True, slots=True)
class RequestView:
    """One running request inside an engine (from ``events.RunningRequest``)."""

    request_id: str
    version: int
    generated: int
    """Completion tokens generated so far."""
    max_tokens: int
    kv_blocks: int
    """KV blocks the request holds now (moves with it on migration)."""
    priority: int = 0
    """Current priority (the service remembers what it raised; RunningRequest lacks it)."""
    dispatched_at: float = 0.0
    last_migrated_at: float | None = None
    """When it was last migrated (service memory, from MigrationRecord); None if never."""
    preempted: bool = False
    """Waiting on its engine after a KV-full preemption, holding no KV: moving it costs only
    its tokens, and any engine of its version with room can resume it."""


@dataclass(frozen=True, slots=True)
class EngineView:
    """One engine replica (DP group) as last reported."""

    engine_id: str
    state: EngineState
    version: int | None
    """Loaded weights version; None when it holds none."""
    assigned_version: int | None
    """Version the orchestrator assigned; None when unassigned."""
    kv_blocks_total: int
    kv_blocks_used: int = 0
    block_size: int = 16
    max_running: int = 0
    """Most concurrent requests; 0 means bounded by KV blocks only."""
    tokens_per_s: float = 0.0
    """Recent decode throughput of the whole engine (0 when unknown)."""
    waiting: int = 0
    """Requests pulled but not yet running (engine-local queue)."""
    requests: tuple[RequestView, ...] = ()
    assigned_at: float | None = None
    """When the orchestrator last assigned it (service memory); None if never/unknown."""
    kind: str = "dora"
    """Engine kind ('dora' built-in, 'vllm'): requests migrate only within a kind."""

    def __post_init__(self) -> None:
        if self.state not in ENGINE_STATES:
            raise ValueError(f"EngineView.state: unknown state {self.state!r} ({self.engine_id})")
        if self.kv_blocks_total < 0 or self.kv_blocks_used < 0:
            raise ValueError(f"EngineView.kv_blocks_*: negative ({self.engine_id})")
        if self.max_running < 0 or self.waiting < 0 or self.block_size < 1:
            raise ValueError(
                f"EngineView.max_running/waiting/block_size invalid ({self.engine_id})"
            )

    @classmethod
    def from_status(
        cls,
        status: EngineStatus,
        *,
        priorities: Mapping[str, int] | None = None,
        migrated_at: Mapping[str, float] | None = None,
        assigned_at: float | None = None,
    ) -> EngineView:
        """The view of an ``EngineStatus`` event plus what only the service remembers: the
        priorities it raised (``Prioritize``), when requests last migrated (``MigrationRecord``)
        and when it last assigned the engine (``AssignVersion``)."""
        prio = priorities or {}
        moved = migrated_at or {}
        return cls(
            engine_id=status.engine_id,
            state=status.state,
            version=status.version,
            assigned_version=status.assigned_version,
            kv_blocks_total=status.kv_blocks_total,
            kv_blocks_used=status.kv_blocks_used,
            block_size=status.block_size,
            max_running=status.max_running,
            tokens_per_s=status.tokens_per_s,
            waiting=status.waiting,
            requests=tuple(
                RequestView(
                    r.request_id,
                    r.version,
                    r.generated,
                    r.max_tokens,
                    r.kv_blocks,
                    prio.get(r.request_id, 0),
                    r.dispatched_at,
                    moved.get(r.request_id),
                    r.preempted,
                )
                for r in status.requests
            ),
            assigned_at=assigned_at,
            kind=status.engine_kind,
        )

    @property
    def running(self) -> int:
        return len(self.requests)

    @property
    def free_blocks(self) -> int:
        return max(0, self.kv_blocks_total - self.kv_blocks_used)

    @property
    def pulls(self) -> int | None:
        """The version whose queue this engine takes work from (now or after loading)."""
        if self.state in ("serving", "loading"):
            return self.assigned_version
        return None

    @property
    def occupancy(self) -> float:
        """Fraction of the engine in use: the larger of KV-block use and slot use."""
        kv = self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 1.0
        if self.max_running:
            return max(kv, (len(self.requests) + self.waiting) / self.max_running)
        return kv


@dataclass(frozen=True, slots=True)
class ClusterState:
    """Everything ``plan`` decides from."""

    now: float
    engines: tuple[EngineView, ...]
    queue_depths: Mapping[int, int] = field(default_factory=dict)
    """Version -> requests waiting on ``requests.v<N>`` (not yet pulled by any engine)."""
    newest_version: int = 0
    """Newest published weights version (the learner's latest)."""
    learner_step: int = 0
    """Learner steps taken; the next step to run is ``learner_step``."""
    staleness_bound: int = 1
    """K: a group tagged ``u`` must be trained at a step ``<= u + K``."""
    lengths: LengthModel = field(default_factory=LengthModel)
    """Finished-length distribution for remaining-work estimates."""

    def __post_init__(self) -> None:
        for version, depth in self.queue_depths.items():
            if depth < 0:
                raise ValueError(f"ClusterState.queue_depths[{version}]: negative depth {depth}")
        if self.staleness_bound < 0 or self.learner_step < 0 or self.newest_version < 0:
            raise ValueError("ClusterState: staleness_bound/learner_step/newest_version < 0")
        ids = {e.engine_id for e in self.engines}
        if len(ids) != len(self.engines):
            raise ValueError("ClusterState.engines: duplicate engine_id")

    def deadline(self, version: int) -> int:
        """Last learner step that may train on a group of ``version``."""
        return version + self.staleness_bound

    def steps_left(self, version: int) -> int:
        """Learner steps before ``version``'s deadline step runs (0: the next step needs it)."""
        return version + self.staleness_bound - self.learner_step
