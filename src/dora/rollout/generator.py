"""The generator stage: one engine replica serving one policy version at a time.

It pulls ``RolloutRequest``s from ``requests.v<N>`` of the version it is assigned, only while
the engine has room (the durable consumer's ``max_ack_pending`` and our own ``max_running``
are the backpressure), publishes one ``Trajectory`` per finished request, reports
``EngineStatus`` periodically, and obeys control commands sent by request-reply on
``control.<engine>`` (assign, drain, prioritize, and the migrator's export / import /
release / restore).

Delivery guarantees: a request's queue message stays unacked while it is generated, with
in-progress heartbeats; it is acked only after its trajectory is stored. The message's ack
token is a *lease* that moves with the request when it migrates, so whichever engine finishes
it acks it, and a crash anywhere means redelivery under the request's own version. Trajectory
event ids are derived from request ids, so a regenerated duplicate is deduplicated by the bus.

All engine calls run on one worker thread: the engine is single-threaded and the event loop
stays free for the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import structlog
from pydantic import TypeAdapter, ValidationError

from dora.aio import cancel_all
from dora.bus import Bus, ConsumerSpec, Message
from dora.engines.base import Engine, EngineError, VersionMismatch
from dora.events import (
    AssignVersion,
    ControlCommand,
    ControlReply,
    DeadLetter,
    Drain,
    EngineStatus,
    ExportRequest,
    ImportRequest,
    Prioritize,
    ReleaseExported,
    RestoreExported,
    RolloutRequest,
    Trajectory,
)
from dora.rollout.partial import resumed, retag
from dora.subjects import Subjects

log = structlog.get_logger(__name__)
T = TypeVar("T")

WeightSource = Callable[[int], Awaitable[Mapping[str, Any] | Path]]
"""Returns the weights of a version (state dict or checkpoint dir), verified."""

RolloutMode = Literal["dora", "sync", "one_step_off", "partial"]

_COMMANDS: TypeAdapter[Any] = TypeAdapter(ControlCommand)


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


@dataclass
class _Held:
    """A request the engine holds, and the lease on its queue message."""

    lease: Message
    exported: bool = False
    exported_at: float = 0.0


@dataclass
class GeneratorStats:
    """Counters for tests and reports."""

    pulled: int = 0
    finished: int = 0
    exported: int = 0
    imported: int = 0
    restored: int = 0
    resubmitted: int = 0
    dead_lettered: int = 0
    weight_loads: list[tuple[int, float]] = field(default_factory=list)


class Generator:
    """Runs an ``Engine`` against the bus; ``await run()`` until ``stop()``."""

    def __init__(
        self, engine: Engine, bus: Bus, weights: WeightSource, config: GeneratorConfig
    ) -> None:
        self.engine = engine
        self.bus = bus
        self.weights = weights
        self.config = config
        self.subjects = bus.subjects
        self.assigned: int | None = config.initial_version
        self.draining = False
        self.state: str = "idle"
        self.stats = GeneratorStats()
        self._held: dict[str, _Held] = {}
        self._resumes: list[RolloutRequest] = []
        """Partial rollout: requests interrupted by an update, re-added first after the load
        (their leases stay in ``_held``)."""
        self._backlog: set[int] = set()
        """Partial rollout: older versions whose queues are served before the assigned one."""
        self._consumers: dict[int, Any] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"engine-{config.engine_id}")
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self.ready = asyncio.Event()
        """Set once the generator answers control commands."""
        self._log = log.bind(engine=config.engine_id)

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Serve until stopped; in-flight requests are naked (redelivered) on the way out.

        Two loops share the engine: one pulls requests while there is room, one steps the
        engine; every engine call is serialized on the engine's thread.
        """
        control = await self.bus.serve(self.subjects.control(self.config.engine_id), self._control)
        self.ready.set()
        tasks = [
            asyncio.create_task(self._report_status()),
            asyncio.create_task(self._heartbeat()),
            asyncio.create_task(self._pull_loop()),
        ]
        try:
            while not self._stop.is_set():
                await self._maybe_load_weights()
                if await self._call(self.engine.has_work):
                    await self._step()
                else:
                    await self._idle_wait()
        finally:
            await cancel_all(tasks)
            await control.unsubscribe()
            await self._release_all()
            for consumer in self._consumers.values():
                await consumer.close()
            self._pool.shutdown(wait=True)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _idle_wait(self) -> None:
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=self.config.fetch_timeout_s)

    async def _release_all(self) -> None:
        """On stop: hand every held request back to the queue (it is regenerated elsewhere)."""
        for held in self._held.values():
            if not held.exported:
                await held.lease.nak()
        self._held.clear()

    # ------------------------------------------------------------------ weights

    async def _maybe_load_weights(self) -> None:
        target = self.assigned
        if target is None or (self.engine.version == target and not self._resumes):
            if target is not None and self.state in ("idle", "loading"):
                self.state = "draining" if self.draining else "serving"
            return
        if await self._call(self.engine.num_requests) > 0:
            return  # finish the old version's requests first (never mix versions)
        self.state = "loading"
        started = time.monotonic()
        weights = await self.weights(target)
        if self.assigned != target:
            return  # reassigned again while fetching
        resumes, self._resumes = self._resumes, []
        try:
            failed = await self._call(self._load_and_resume, target, weights, resumes)
        except VersionMismatch:
            # a pull that was in flight when the assignment changed slipped a request of
            # the old version in: finish it first, load on a later round
            self._resumes = resumes + self._resumes
            self.state = "serving"
            return
        for rid, reason in failed:
            held = self._held.pop(rid, None)
            if held is not None:
                await held.lease.nak()  # redelivered on its original queue (the backlog)
            self._log.warning("resume_failed", request=rid, reason=reason)
        self.stats.weight_loads.append((target, time.time()))
        self.state = "draining" if self.draining else "serving"
        self._room.set()
        self._log.info("weights_loaded", version=target, seconds=time.monotonic() - started)

    def _load_and_resume(
        self, version: int, weights: Any, resumes: list[RolloutRequest]
    ) -> list[tuple[str, str]]:
        """Engine thread: load, then re-add interrupted requests before anything else can be
        pulled in (one thread job); returns the ones the engine refused."""
        self.engine.load_weights(version, weights)
        failed = []
        for request in resumes:
            if request.version != version:  # a second update came before this load
                request = retag(request, version)
            try:
                self.engine.add_request(request)
            except EngineError as exc:
                failed.append((request.request_id, f"{type(exc).__name__}: {exc}"))
        return failed

    # ------------------------------------------------------------------ pulling

    async def _consumer(self, version: int) -> Any:
        if version not in self._consumers:
            spec = request_queue_spec(self.subjects, version, self.config.queue_ack_wait_s)
            self._consumers[version] = await self.bus.consumer(spec)
        return self._consumers[version]

    async def _pull_loop(self) -> None:
        while True:
            version = self.assigned
            room = self.config.max_running - len(self._held)
            if version is None or self.draining or self.engine.version != version or room <= 0:
                await self._room.wait()
                self._room.clear()
                continue
            if self._backlog and await self._pull_backlog(version, room):
                self._wake.set()
                continue
            consumer = await self._consumer(version)
            msgs = await consumer.fetch(batch=room, timeout=self.config.fetch_timeout_s)
            for msg in msgs:
                await self._admit(msg, version)
            if msgs:
                self._wake.set()

    async def _pull_backlog(self, version: int, room: int) -> bool:
        """Partial rollout: take requests still queued under older versions first (they were
        dispatched earlier, or come back from a crashed engine). A version is forgotten once
        its queue is settled (nothing queued or unacked) and it is two versions old."""
        for old in sorted(self._backlog):
            if old >= version:
                self._backlog.discard(old)
                continue
            consumer = await self._consumer(old)
            state = await consumer.state()
            if state.depth == 0 and old < version - 1:
                self._backlog.discard(old)
            if state.pending == 0:
                continue
            msgs = await consumer.fetch(batch=room, timeout=self.config.fetch_timeout_s / 10)
            for msg in msgs:
                await self._admit(msg, version, old)
            if msgs:
                return True
        return False

    async def _admit(self, msg: Message, version: int, queue: int | None = None) -> None:
        """Add a pulled request (from ``version``'s queue, or an older ``queue`` in partial
        rollout, where it is retagged to ``version``)."""
        try:
            request = RolloutRequest.model_validate_json(msg.data)
            if request.version != (version if queue is None else queue):
                raise EngineError(
                    f"request tagged v{request.version} arrived on the "
                    f"v{version if queue is None else queue} queue"
                )
            if self.engine.version != version or self.assigned != version:
                # Reassigned while this fetch was in flight (maybe already loading the new
                # weights): not a bad request, just no longer ours. Hand it back.
                await msg.nak()
                return
            if queue is not None:
                request = retag(request, version)
            await self._call(self.engine.add_request, request)
        except (ValidationError, EngineError) as exc:
            await self._dead_letter(msg, f"{type(exc).__name__}: {exc}")
            return
        self._held[request.request_id] = _Held(msg)
        self.stats.pulled += 1

    async def _dead_letter(self, msg: Message, reason: str) -> None:
        letter = DeadLetter(
            subject=msg.subject,
            payload=msg.data.decode("utf-8", errors="replace"),
            reason=reason,
            stage=f"generator:{self.config.engine_id}",
            deliveries=msg.num_delivered,
        )
        await self.bus.publish_event(self.subjects.deadletter, letter)
        await msg.term()
        self.stats.dead_lettered += 1
        self._log.warning("request_dead_lettered", reason=reason)

    # ------------------------------------------------------------------ generating

    async def _step(self) -> None:
        for trajectory in await self._call(self.engine.step):
            await self._finish(trajectory)

    async def _finish(self, trajectory: Trajectory) -> None:
        request_id = trajectory.request.request_id
        event = trajectory.model_copy(update={"event_id": trajectory_event_id(request_id)})
        await self.bus.publish_event(self.subjects.trajectories, event)
        held = self._held.pop(request_id, None)
        if held is not None:
            await held.lease.ack()
        self.stats.finished += 1
        self._room.set()

    async def _heartbeat(self) -> None:
        # Beat well within the ack wait, or live requests would be redelivered (regenerated
        # twice) when a short ack wait is configured for fast failover.
        interval = min(self.config.heartbeat_interval_s, self.config.queue_ack_wait_s / 3)
        while True:
            await asyncio.sleep(interval)
            for held in list(self._held.values()):
                await held.lease.in_progress()
            await self._reclaim_stale_exports()

    async def _reclaim_stale_exports(self) -> None:
        deadline = time.monotonic() - self.config.export_timeout_s
        for rid, held in list(self._held.items()):
            if held.exported and held.exported_at < deadline:
                try:
                    await self._call(self.engine.restore_exported, rid)
                except (EngineError, KeyError):  # released or restored meanwhile
                    continue
                held.exported = False
                self.stats.restored += 1
                self._log.warning("stale_export_restored", request=rid)
                self._wake.set()

    async def _report_status(self) -> None:
        while True:
            await self.bus.publish_event(
                self.subjects.status(self.config.engine_id), await self.status()
            )
            await asyncio.sleep(self.config.status_interval_s)

    async def status(self) -> EngineStatus:
        """The engine's status with the generator's view (assignment, state) on top."""
        status = await self._call(self.engine.status)
        return status.model_copy(
            update={
                "engine_id": self.config.engine_id,
                "assigned_version": self.assigned,
                "state": self.state,
                "max_running": self.config.max_running,
            }
        )

    # ------------------------------------------------------------------ control

    async def _control(self, data: bytes) -> bytes:
        try:
            command = _COMMANDS.validate_json(data)
            reply = await self._apply(command)
        except (ValidationError, EngineError, KeyError) as exc:
            reply = ControlReply(ok=False, error=f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a command must never kill the engine loop
            self._log.exception("control_failed")
            reply = ControlReply(ok=False, error=f"{type(exc).__name__}: {exc}")
        self._wake.set()
        self._room.set()
        return reply.model_dump_json().encode()

    async def _apply(self, command: Any) -> ControlReply:
        match command:
            case AssignVersion(version=version):
                return await self._assign(version)
            case Drain():
                self.draining = True
                self.state = "draining"
                return ControlReply(ok=True)
            case Prioritize(request_ids=ids, priority=priority):
                for rid in ids:
                    if rid in self._held and not self._held[rid].exported:
                        with contextlib.suppress(EngineError):  # it may just have finished
                            await self._call(self.engine.set_priority, rid, priority)
                return ControlReply(ok=True)
            case ExportRequest():
                return await self._export(command)
            case ImportRequest():
                return await self._import(command)
            case ReleaseExported(request_id=rid):
                held = self._held.pop(rid)
                await self._call(self.engine.release_exported, rid)
                self.stats.exported += 1
                del held
                return ControlReply(ok=True)
            case RestoreExported(request_id=rid):
                await self._call(self.engine.restore_exported, rid)
                self._held[rid].exported = False
                self.stats.restored += 1
                return ControlReply(ok=True)
        return ControlReply(ok=False, error=f"unsupported command {type(command).__name__}")

    async def _assign(self, version: int) -> ControlReply:
        previous = self.assigned
        self.assigned = version
        self.draining = False
        if self.engine.version == version:
            self.state = "serving"
        if self.config.mode == "partial" and previous is not None and previous != version:
            self._backlog.add(previous)
            await self._interrupt_partial(version)
        self._log.info("assigned", version=version, previous=previous)
        return ControlReply(ok=True)

    async def _interrupt_partial(self, version: int) -> None:
        """Partial rollout: abort in-flight work; it is re-added first, under ``version`` with
        its tokens, right after the load (``dora.rollout.partial``). Leases stay held."""
        loaded = self.engine.version
        pending = {r.request_id for r in self._resumes}
        rids = [rid for rid, h in self._held.items() if not h.exported and rid not in pending]
        for part in await self._call(self._abort_all, rids):
            self._resumes.append(resumed(part, loaded, version))
            self.stats.resubmitted += 1

    def _abort_all(self, rids: list[str]) -> list[Any]:
        """Engine thread: abort ``rids`` in one job (one hop for the whole engine); a request
        that finished meanwhile is skipped (its trajectory is on its way)."""
        parts = []
        for rid in rids:
            with contextlib.suppress(EngineError):
                parts.append(self.engine.abort(rid))
        return parts

    async def _export(self, command: ExportRequest) -> ControlReply:
        held = self._held[command.request_id]
        snapshot = await self._call(self.engine.export_request, command.request_id)
        held.exported = True
        held.exported_at = time.monotonic()
        try:
            blob = await self.bus.put_blob(command.blob_name, snapshot)
        except Exception:
            await self._call(self.engine.restore_exported, command.request_id)
            held.exported = False
            raise
        return ControlReply(ok=True, blob=blob, lease=held.lease.ack_token, kv_bytes=len(snapshot))

    async def _import(self, command: ImportRequest) -> ControlReply:
        if self.draining or self.assigned != self.engine.version:
            raise EngineError(f"engine {self.config.engine_id} is not serving; cannot import")
        data = await self.bus.get_blob(command.blob.name)
        request_id = await self._call(self.engine.import_request, data)
        self._held[request_id] = _Held(self.bus.lease(command.lease))
        self.stats.imported += 1
        return ControlReply(ok=True, kv_bytes=len(data))
