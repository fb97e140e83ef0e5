"""The generator's core: one engine, the requests it holds, and its state machine. No bus.

The shell (``dora.rollout.generator``) pulls requests, publishes trajectories, answers control
commands and settles queue leases; this core decides, as vLLM's ``EngineCore`` decides and
``EngineCoreProc`` moves bytes. It never publishes and never acks: methods hand the shell the
leases to settle. Every engine call runs on the engine's own thread (the engine is
single-threaded), so the event loop stays free for the bus.

States, as reported in ``EngineStatus.state``::

    idle --assign--> loading --weights in--> serving <--assign/drain--> draining

- A version is served only once every request of the previous one has finished (or, under the
  ``partial`` baseline, been interrupted to resume under the new weights): a trajectory never
  mixes versions under dora.
- A held request keeps its queue lease until its trajectory is stored; the lease moves with it
  when it migrates (``export`` gives the token, ``import_`` takes it), so whichever engine
  finishes it acks it.
- An export the migrator abandons is restored after ``export_timeout_s``
  (``reclaim_stale_exports``), or the request and its KV would stay parked forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from dora.bus import Message
from dora.engines.base import Engine, EngineError, PartialOutput, TurnEnd, VersionMismatch
from dora.events import EngineStatus, RolloutRequest, Trajectory
from dora.rollout.generator_config import GeneratorConfig, GeneratorStats
from dora.rollout.partial import resumed, retag

T = TypeVar("T")

Admitted = Literal["added", "renewed", "not_ours"]


@dataclass
class Held:
    """A request the engine holds, and the lease on its queue message."""

    lease: Message
    exported: bool = False
    exported_at: float = 0.0


class GeneratorCore:
    """An engine with its held requests, assignment and state (see module docstring)."""

    def __init__(self, engine: Engine, config: GeneratorConfig) -> None:
        self.engine = engine
        self.config = config
        self.assigned: int | None = config.initial_version
        self.draining = False
        self.state: str = "idle"
        self.stats = GeneratorStats()
        self.held: dict[str, Held] = {}
        self.resumes: list[RolloutRequest] = []
        """Partial rollout: requests interrupted by an update, re-added first after the load
        (their leases stay in ``held``)."""
        self.parked: set[str] = set()
        """Multi-turn episodes parked while their environment works (a tool runs): their KV
        stays, but they take no decode slot, so up to ``max_parked`` more are pulled."""
        self.opening: dict[str, Held] = {}
        """Multi-turn episodes pulled but waiting for their environment's opening messages
        (not in the engine yet): they take room, keep their leases, and hold back a load."""
        self.backlog: set[int] = set()
        """Partial rollout: older versions whose queues are served before the assigned one."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"engine-{config.engine_id}")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run an engine call on the engine's own thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> list[Message]:
        """Stop the engine thread; the leases of every request not exported, to hand back."""
        self._pool.shutdown(wait=True)
        leases = [h.lease for h in self.held.values() if not h.exported]
        leases += [h.lease for h in self.opening.values()]
        self.held.clear()
        self.opening.clear()
        return leases

    # ------------------------------------------------------------------ what to pull

    @property
    def serving(self) -> bool:
        """Loaded with the assigned version and not draining: its queue may be pulled."""
        return self.engine.version == self.assigned and not self.draining

    def room(self) -> int:
        """How many more requests to pull now (0 while loading, draining or full)."""
        if self.assigned is None or not self.serving:
            return 0
        parked = len(self.parked)
        decoding = len(self.held) - parked + len(self.opening)
        total = len(self.held) + len(self.opening)
        cfg = self.config
        return max(min(cfg.max_running - decoding, cfg.max_running + cfg.max_parked - total), 0)

    async def admit(
        self, request: RolloutRequest, lease: Message, version: int, queue: int | None = None
    ) -> Admitted:
        """Add ``request``, pulled for ``version`` from its queue (or from an older ``queue`` in
        partial rollout, where it is retagged). ``not_ours``: reassigned while the fetch was in
        flight, hand it back. Raises ``EngineError`` for a request the engine cannot serve."""
        if not self.admissible(request, version, queue):
            return "not_ours"  # maybe already loading the new weights: not a bad request
        held = self.held.get(request.request_id)
        if held is not None and not held.exported:
            # Redelivered while we still generate it (its lease lapsed: heartbeats could not
            # reach the server, e.g. during a NATS outage). The new delivery is the live lease;
            # the request keeps running here, once.
            held.lease = lease
            self.stats.rebound += 1
            return "renewed"
        if queue is not None:
            request = retag(request, version)
        if not await self.call(self._add_if_serving, request, version):
            return "not_ours"  # a load of other weights was running on the engine thread
        self.held[request.request_id] = Held(lease)
        self.stats.pulled += 1
        return "added"

    def admissible(self, request: RolloutRequest, version: int, queue: int | None) -> bool:
        """Whether ``request``, pulled for ``version`` (from ``queue`` when older), may be
        served now: False when the engine was reassigned meanwhile; ``EngineError`` for a
        request tagged with another version than its queue's."""
        source = version if queue is None else queue
        if request.version != source:
            raise EngineError(f"request tagged v{request.version} arrived on the v{source} queue")
        return self.engine.version == version and self.assigned == version

    def _add_if_serving(self, request: RolloutRequest, version: int) -> bool:
        """Engine thread: add ``request`` only if the engine still serves ``version``. The
        check above reads the version from the event loop while a load may be running here
        (assigned v+1, loading, then assigned back to v): checked again where it cannot race."""
        if self.engine.version != version:
            return False
        self.engine.add_request(request)
        return True

    # ------------------------------------------------------------------ generating

    async def has_work(self) -> bool:
        return await self.call(self.engine.has_work)

    async def step(self) -> list[Trajectory]:
        return await self.call(self.engine.step)

    async def step_turns(self) -> tuple[list[Trajectory], list[TurnEnd]]:
        """One step, and the multi-turn requests it parked: one job on the engine thread."""
        return await self.call(self._step_turns)

    def _step_turns(self) -> tuple[list[Trajectory], list[TurnEnd]]:
        finished = self.engine.step()
        return finished, self.engine.take_turn_ends()  # type: ignore[attr-defined]

    def finish(self, trajectory: Trajectory) -> Message | None:
        """The trajectory is stored: the lease to ack (None for a request no longer held)."""
        self.parked.discard(trajectory.request.request_id)
        held = self.held.pop(trajectory.request.request_id, None)
        self.stats.finished += 1
        self.stats.reprefilled_tokens += trajectory.reprefilled_tokens
        return None if held is None else held.lease

    # ------------------------------------------------------------------ weights

    async def load_target(self) -> int | None:
        """The version to load now, or None (nothing assigned, already loaded, or the old
        version's requests still running: versions never mix)."""
        target = self.assigned
        if target is None or (self.engine.version == target and not self.resumes):
            if target is not None and self.state in ("idle", "loading"):
                self.state = "draining" if self.draining else "serving"
            return None
        if self.opening or await self.call(self.engine.num_requests) > 0:
            return None
        self.state = "loading"
        return target

    async def load(self, version: int, weights: Any) -> list[tuple[Message, str, str]] | None:
        """Load ``version`` and re-add the interrupted requests first (partial rollout); the
        (lease, request id, reason) of each the engine refused, or None when a request of the
        old version slipped in meanwhile (finish it, load on a later round)."""
        if self.assigned != version:
            return []  # reassigned again while fetching
        resumes, self.resumes = self.resumes, []
        try:
            refused = await self.call(self._load_and_resume, version, weights, resumes)
        except VersionMismatch:
            self.resumes = resumes + self.resumes
            self.state = "serving"
            return None
        failed = []
        for rid, reason in refused:
            held = self.held.pop(rid, None)
            if held is not None:
                failed.append((held.lease, rid, reason))
        self.stats.weight_loads.append((version, time.time()))
        self.state = "draining" if self.draining else "serving"
        return failed

    def _load_and_resume(
        self, version: int, weights: Any, resumes: list[RolloutRequest]
    ) -> list[tuple[str, str]]:
        """Engine thread: load, then re-add interrupted requests before anything else can be
        pulled in (one thread job); returns the ones the engine refused."""
        self.engine.load_weights(version, weights)
        refused = []
        for request in resumes:
            if request.version != version:  # a second update came before this load
                request = retag(request, version)
            try:
                self.engine.add_request(request)
            except EngineError as exc:
                refused.append((request.request_id, f"{type(exc).__name__}: {exc}"))
        return refused

    # ------------------------------------------------------------------ commands

    async def assign(self, version: int) -> None:
        previous = self.assigned
        self.assigned = version
        self.draining = False
        if self.engine.version == version:
            self.state = "serving"
        if self.config.mode == "partial" and previous is not None and previous != version:
            self.backlog.add(previous)
            await self._interrupt_partial(version)

    def drain(self) -> None:
        self.draining = True
        self.state = "draining"

    async def prioritize(self, request_ids: list[str], priority: int) -> None:
        for rid in request_ids:
            if rid in self.held and not self.held[rid].exported:
                with contextlib.suppress(EngineError):  # it may just have finished
                    await self.call(self.engine.set_priority, rid, priority)

    async def _interrupt_partial(self, version: int) -> None:
        """Partial rollout: abort in-flight work; it is re-added first, under ``version`` with
        its tokens, right after the load (``dora.rollout.partial``). Leases stay held."""
        loaded = self.engine.version
        pending = {r.request_id for r in self.resumes}
        rids = [rid for rid, h in self.held.items() if not h.exported and rid not in pending]
        for part in await self.call(self._abort_all, rids):
            self.resumes.append(resumed(part, loaded, version))
            self.stats.resubmitted += 1

    def _abort_all(self, rids: list[str]) -> list[PartialOutput]:
        """Engine thread: abort ``rids`` in one job; one that finished meanwhile is skipped
        (its trajectory is on its way)."""
        parts = []
        for rid in rids:
            with contextlib.suppress(EngineError):
                parts.append(self.engine.abort(rid))
        return parts

    # ------------------------------------------------------------------ migration

    async def export(self, request_id: str) -> tuple[bytes, str]:
        """Park ``request_id`` for a move: its KV snapshot and its lease's token."""
        held = self.held.get(request_id)
        if held is None:  # the orchestrator planned on a snapshot taken before it finished
            raise EngineError(
                f"request {request_id!r} is no longer on {self.config.engine_id} "
                "(finished before the export; nothing to move)"
            )
        snapshot = await self.call(self.engine.export_request, request_id)
        held.exported = True
        held.exported_at = time.monotonic()
        return snapshot, held.lease.ack_token

    async def import_(self, snapshot: bytes, lease: Message) -> str:
        """Continue a migrated request here; its id. An engine assigned a newer version
        that still finishes the old one's tail takes more of that tail (consolidation packs
        short tails into long ones); the engine refuses a snapshot of another version than
        its weights, so an import that races a weight load fails and the source keeps it."""
        if self.draining or self.state == "loading" or self.engine.version is None:
            raise EngineError(f"engine {self.config.engine_id} is not serving; cannot import")
        request_id = await self.call(self.engine.import_request, snapshot)
        self.held[request_id] = Held(lease)
        self.stats.imported += 1
        return request_id

    async def release_exported(self, request_id: str) -> None:
        """The target imported it: forget it here (its lease now lives there)."""
        self.held.pop(request_id)  # KeyError (an error reply) when it is not held here
        self.parked.discard(request_id)
        await self.call(self.engine.release_exported, request_id)
        self.stats.exported += 1

    async def restore_exported(self, request_id: str) -> None:
        """The migration failed: the request goes on generating here."""
        await self.call(self.engine.restore_exported, request_id)
        self.held[request_id].exported = False
        self.stats.restored += 1

    async def reclaim_stale_exports(self) -> list[str]:
        """Restore exports neither released nor restored within ``export_timeout_s``."""
        deadline = time.monotonic() - self.config.export_timeout_s
        reclaimed = []
        for rid, held in list(self.held.items()):
            if held.exported and held.exported_at < deadline:
                try:
                    await self.call(self.engine.restore_exported, rid)
                except (EngineError, KeyError):  # released or restored meanwhile
                    continue
                held.exported = False
                self.stats.restored += 1
                reclaimed.append(rid)
        return reclaimed

    # ------------------------------------------------------------------ reporting

    async def status(self) -> EngineStatus:
        """The engine's status with the generator's view (assignment, state) on top."""
        status = await self.call(self.engine.status)
        return status.model_copy(
            update={
                "engine_id": self.config.engine_id,
                "assigned_version": self.assigned,
                "state": self.state,
                "max_running": self.config.max_running,
            }
        )

    def leases(self) -> list[Message]:
        """Every lease held (exported ones too: the migration may still fail back here)."""
        return [h.lease for h in (*self.held.values(), *self.opening.values())]
