"""The live orchestrator: builds ``ClusterState`` from the bus, calls ``plan``, sends commands.

It keeps no state that cannot be rebuilt: engines report their version, assignment and
running requests in ``EngineStatus`` every fraction of a second, queue depths come from the
request-queue consumers, the learner's step and K from the dispatcher's ledger (KV store), and
the length distribution from finished trajectories. A restarted orchestrator therefore
resumes from the next status round. What it remembers (when it assigned an engine, when it
migrated a request, priorities it raised) only feeds hysteresis.

Migrations run in the background through the ``Migrator``; requests being migrated are hidden
from ``plan`` until their move is settled, so a request is never in two migrations at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field

import structlog

from dora.aio import cancel_all
from dora.bus import Bus, ConsumerSpec, ConsumerState, Message
from dora.events import EngineStatus, Event, Ledger, Trajectory
from dora.rollout.actions import (
    Action,
    AssignEngine,
    DrainEngine,
    MigrateRequests,
    PrioritizeRequests,
)
from dora.rollout.control_client import ControlClient, ControlFailed
from dora.rollout.estimates import LengthRecorder
from dora.rollout.generator_config import QUEUE_ACK_WAIT_S, request_queue_spec
from dora.rollout.migrator import Migrator
from dora.rollout.orchestrator import DEFAULT_CONFIG, OrchestratorConfig, plan
from dora.rollout.state import ClusterState, EngineView
from dora.rollout.status_board import StatusBoard
from dora.stage.pull import observe
from dora.subjects import LEDGER_KEY

log = structlog.get_logger(__name__)


@dataclass
class OrchestratorServiceConfig:
    """How often to plan and when an engine counts as gone."""

    tick_s: float = 0.25
    engine_timeout_s: float = 5.0
    command_timeout_s: float = 10.0
    queue_ack_wait_s: float = QUEUE_ACK_WAIT_S
    """Ack wait of a request-queue consumer this service creates before any engine does; it
    must be the generators' (JetStream keeps the first definition, so a longer one here
    would delay the redelivery of a dead engine's requests)."""
    policy: OrchestratorConfig = field(default_factory=lambda: DEFAULT_CONFIG)


@dataclass
class _Memory:
    """Hysteresis inputs the status events do not carry."""

    assigned_at: dict[str, float] = field(default_factory=dict)
    migrated_at: dict[str, float] = field(default_factory=dict)
    priority: dict[str, int] = field(default_factory=dict)
    migrating: set[str] = field(default_factory=set)


class QueueDepths:
    """Depth of each version's request queue as a controller must see it.

    Requests never delivered, plus *orphans*: requests delivered to an engine that died. An
    orphan stays unacked (in ``ack_pending``) until its lease expires and it is redelivered,
    and no live engine reports it. Unless it counts as queued work, a controller may leave its
    version without a puller and the redelivered request waits forever. The excess of unacked
    over held requests also shows briefly after every pull or during a migration (status
    lags), so it counts only once it has lasted ``orphan_grace_s``.
    """

    def __init__(self, bus: Bus, ack_wait_s: float, orphan_grace_s: float) -> None:
        self.bus = bus
        self.ack_wait_s = ack_wait_s
        self.orphan_grace_s = orphan_grace_s
        self._queues: dict[int, object] = {}
        self._excess_since: dict[int, float] = {}
        self.last: dict[int, ConsumerState] = {}
        """The consumer state each version's last depth was computed from."""

    async def depth(self, version: int, held: int, now: float) -> int:
        """``held``: requests of ``version`` that live engines report holding."""
        if version not in self._queues:
            spec = request_queue_spec(self.bus.subjects, version, self.ack_wait_s)
            self._queues[version] = await self.bus.consumer(spec)
        state = await self._queues[version].state()  # type: ignore[attr-defined]
        self.last[version] = state
        excess = int(state.ack_pending) - held
        if excess <= 0:
            self._excess_since.pop(version, None)
            return int(state.pending)
        since = self._excess_since.setdefault(version, now)
        if now - since < self.orphan_grace_s:
            return int(state.pending)
        log.info("orphaned_requests", version=version, count=excess)
        return int(state.pending) + excess

    async def close(self) -> None:
        for consumer in self._queues.values():
            await consumer.close()  # type: ignore[attr-defined]


class OrchestratorService:
    """``await run()`` until ``stop()``; ``actions`` keeps everything it decided."""

    def __init__(self, bus: Bus, config: OrchestratorServiceConfig | None = None) -> None:
        self.bus = bus
        self.config = config or OrchestratorServiceConfig()
        self.control = ControlClient(bus, timeout_s=self.config.command_timeout_s)
        self.migrator = Migrator(bus, control=self.control)
        self.engines = StatusBoard(bus, owner="orchestrator")
        self.lengths = LengthRecorder()
        self.memory = _Memory()
        self.actions: list[tuple[float, Action]] = []
        self.ledger: Ledger | None = None
        self._depths = QueueDepths(
            bus, self.config.queue_ack_wait_s, orphan_grace_s=self.config.engine_timeout_s
        )
        self._stop = asyncio.Event()
        self._migrations: set[asyncio.Task[None]] = set()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        await self.engines.start()
        lengths = await self.bus.consumer(
            ConsumerSpec("orchestrator", self.bus.subjects.trajectories)
        )
        tasks = [asyncio.create_task(observe(lengths, self._record_lengths, "orchestrator"))]
        try:
            while not self._stop.is_set():
                await self.tick()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.config.tick_s)
        finally:
            await cancel_all(tasks)
            await asyncio.gather(*self._migrations, return_exceptions=True)
            await self.engines.close()
            await lengths.close()
            await self._depths.close()

    # ------------------------------------------------------------------ inputs

    async def _record_lengths(self, msgs: list[Message]) -> None:
        """Completion lengths for the estimates (a bad trajectory is the recorder's to keep)."""
        for msg in msgs:
            with contextlib.suppress(ValueError):
                traj = Trajectory.model_validate_json(msg.data)
                self.lengths.add(len(traj.completion_token_ids))
            await msg.ack()

    async def _read_ledger(self) -> Ledger | None:
        raw = await self.bus.kv_get(LEDGER_KEY)
        return None if raw is None else Ledger.model_validate_json(raw)

    # ------------------------------------------------------------------ state

    async def build_state(self) -> ClusterState:
        """The ``plan`` input from what the bus told us most recently."""
        now = time.monotonic()
        self.ledger = await self._read_ledger() or self.ledger
        ledger = self.ledger
        learner_step = ledger.learner_step if ledger else 0
        versions = {v.version for v in ledger.versions} if ledger else set()
        engines = []
        held: Counter[int] = Counter()
        for engine_id, status in sorted(self.engines.latest.items()):
            gone = now - self.engines.seen[engine_id] > self.config.engine_timeout_s
            engines.append(self._view(status, "stopped" if gone else None))
            if status.assigned_version is not None:
                versions.add(status.assigned_version)
            if not gone:
                held.update(r.version for r in status.requests)
                versions.update(held)
        depths = {v: await self._depths.depth(v, held[v], now) for v in sorted(versions)}
        return ClusterState(
            now=now,
            engines=tuple(engines),
            queue_depths=depths,
            newest_version=learner_step,
            learner_step=learner_step,
            staleness_bound=ledger.staleness_bound if ledger else 1,
            lengths=self.lengths.model(),
        )

    def _view(self, status: EngineStatus, override: str | None) -> EngineView:
        """The engine as ``plan`` sees it; requests being migrated are hidden."""
        moving = self.memory.migrating
        if moving:
            kept = tuple(r for r in status.requests if r.request_id not in moving)
            status = status.model_copy(update={"requests": kept})
        if override is not None:
            status = status.model_copy(update={"state": override})
        return EngineView.from_status(
            status,
            priorities=self.memory.priority,
            migrated_at=self.memory.migrated_at,
            assigned_at=self.memory.assigned_at.get(status.engine_id),
        )

    # ------------------------------------------------------------------ acting

    async def tick(self) -> list[Action]:
        """One round: build the state, plan, apply."""
        if not self.engines.latest:
            return []
        state = await self.build_state()
        actions = plan(state, self.config.policy)
        for action in actions:
            self.actions.append((state.now, action))
            await self._apply(action, state.now)
        return actions

    async def _apply(self, action: Action, now: float) -> None:
        match action:
            case AssignEngine(engine_id=engine_id, version=version):
                if await self._send(engine_id, action.to_command()):
                    self.memory.assigned_at[engine_id] = now
                    self.engines.assume(engine_id, assigned_version=version, state="serving")
            case DrainEngine(engine_id=engine_id):
                if await self._send(engine_id, action.to_command()):
                    self.engines.assume(engine_id, state="draining")
            case PrioritizeRequests(engine_id=engine_id, request_ids=ids, priority=priority):
                if await self._send(engine_id, action.to_command()):
                    self.memory.priority.update(dict.fromkeys(ids, priority))
            case MigrateRequests(request_ids=ids):
                self.memory.migrating.update(ids)
                task = asyncio.create_task(self._migrate(action))
                self._migrations.add(task)
                task.add_done_callback(self._migrations.discard)

    async def _send(self, engine_id: str, command: Event) -> bool:
        try:
            await self.control.send(engine_id, command)
        except ControlFailed as exc:
            log.warning("command_failed", engine=engine_id, error=exc.reason)
            return False
        return True

    async def _migrate(self, action: MigrateRequests) -> None:
        try:
            outcomes = await self.migrator.execute(action.to_command())
            now = time.monotonic()
            for outcome in outcomes:
                self.memory.migrated_at[outcome.request_id] = now
        finally:
            self.memory.migrating.difference_update(action.request_ids)
