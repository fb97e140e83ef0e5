"""The generator: one engine replica on the bus, serving one policy version at a time.

A thin shell around ``GeneratorCore`` (the engine, its held requests and its state machine):
it pulls ``RolloutRequest``s from ``requests.v<N>`` of the assigned version only while the
core has room (the pull is the backpressure), publishes one ``Trajectory`` per finished
request, publishes ``EngineStatus`` every ``status_interval_s``, heartbeats the leases it
holds, and answers control commands by request-reply on ``control.<engine>`` (assign, drain,
prioritize, and the migrator's export / import / release / restore).

With ``GeneratorConfig.episodes`` every request is a multi-turn episode: the shell hands
opening, parked turns, replies and migrations to ``dora.rollout.episodes.Episodes``.

Delivery: a request's queue message stays unacked while it is generated and is acked only
after its trajectory is stored; a crash anywhere means redelivery under the request's own
version. Trajectory event ids derive from request ids, so a regenerated duplicate is dropped
by the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import structlog
from pydantic import TypeAdapter, ValidationError

from dora.aio import cancel_all
from dora.bus import Bus, Message, Subscription
from dora.engines.base import Engine, EngineError
from dora.envs.chat import check_append_only
from dora.events import (
    AssignVersion,
    ControlCommand,
    ControlReply,
    Drain,
    EngineStatus,
    EnvReply,
    ExportRequest,
    ImportRequest,
    Prioritize,
    ReleaseExported,
    RestoreExported,
    RolloutRequest,
    Trajectory,
)
from dora.rollout.episodes import EpisodeConfig, Episodes
from dora.rollout.generator_config import (
    GeneratorConfig,
    WeightSource,
    request_queue_spec,
    trajectory_event_id,
)
from dora.rollout.generator_core import GeneratorCore
from dora.stage.deadletter import dead_letter, parse_event
from dora.stage.pull import Puller

log = structlog.get_logger("dora.rollout.generator")

_COMMANDS: TypeAdapter[Any] = TypeAdapter(ControlCommand)


class Generator:
    """Runs a ``GeneratorCore`` against the bus; ``await run()`` until ``stop()``."""

    def __init__(
        self, engine: Engine, bus: Bus, weights: WeightSource, config: GeneratorConfig
    ) -> None:
        self.core = GeneratorCore(engine, config)
        self.engine, self.stats, self.held = engine, self.core.stats, self.core.held
        self.bus = bus
        self.weights = weights
        self.config = config
        self.subjects = bus.subjects
        self.ready = asyncio.Event()
        """Set once the generator answers control commands."""
        self._pullers: dict[int, Puller] = {}
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._log = log.bind(engine=config.engine_id)
        self.episodes = None if config.episodes is None else self._episodes(config.episodes)

    def _episodes(self, config: EpisodeConfig) -> Episodes:
        """Multi-turn episodes need an engine that parks turns and a chat format that never
        re-tokenizes history (checked here: the generator refuses to start otherwise)."""
        tokenizer = getattr(self.engine, "tokenizer", None)
        if tokenizer is None or not hasattr(self.engine, "append"):
            raise EngineError(f"engine {self.config.engine_id} cannot run multi-turn episodes")
        check_append_only(config.chat, tokenizer.encode)
        return Episodes(
            config,
            self.core,
            self.bus,
            lambda text, bos: tokenizer.encode(text, add_bos=bos),
            tokenizer.decode,
            self._store,
            self._nudge,
        )

    def _nudge(self) -> None:
        """Something changed for the engine loop and the pull (room)."""
        self._wake.set()
        self._room.set()

    @property
    def state(self) -> str:
        return self.core.state

    @property
    def assigned(self) -> int | None:
        return self.core.assigned

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    async def status(self) -> EngineStatus:
        return await self.core.status()

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Serve until stopped; held requests are handed back (redelivered) on the way out."""
        control = await self.bus.serve(self.subjects.control(self.config.engine_id), self._control)
        tasks = [
            asyncio.create_task(self._report_status()),
            asyncio.create_task(self._heartbeat()),
            asyncio.create_task(self._pull_loop()),
            asyncio.create_task(self._release_loop()),
        ]
        if self.episodes is not None:
            replies = await self.bus.subscribe(self.subjects.env_replies_all)
            tasks += [
                asyncio.create_task(self._replies_loop(replies, self.episodes)),
                asyncio.create_task(self._episode_clock(self.episodes)),
            ]
        self.ready.set()
        try:
            while not self._stop.is_set():
                await self._maybe_load_weights()
                if not await self.core.has_work():
                    await self._idle_wait()
                elif self.episodes is None:
                    for trajectory in await self.core.step():
                        await self._finish(trajectory)
                else:  # the step and the turns it parked, in one engine-thread job
                    finished, ends = await self.core.step_turns()
                    for trajectory in finished:
                        await self._finish(trajectory)
                    await self.episodes.turn_ends(ends)
        finally:
            await cancel_all(tasks)
            await control.unsubscribe()
            for lease in self.core.close():
                await lease.nak()
            for puller in self._pullers.values():
                await puller.consumer.close()

    async def _idle_wait(self) -> None:
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=self.config.fetch_timeout_s)

    async def _maybe_load_weights(self) -> None:
        target = await self.core.load_target()
        if target is None:
            return
        started = time.monotonic()
        failed = await self.core.load(target, await self.weights(target))
        for lease, rid, reason in failed or ():
            await lease.nak()  # redelivered on its original queue (the backlog)
            self._log.warning("resume_failed", request=rid, reason=reason)
        if failed is not None and self.core.engine.version == target:
            self._room.set()
            self._log.info("weights_loaded", version=target, seconds=time.monotonic() - started)

    async def _finish(self, trajectory: Trajectory) -> None:
        if self.episodes is not None and await self.episodes.finished(trajectory):
            return  # its environment sees the last turn first
        await self._store(trajectory)

    async def _store(self, trajectory: Trajectory) -> None:
        """Publish the trajectory, then ack its request (a crash between: redelivery)."""
        request_id = trajectory.request.request_id
        event = trajectory.model_copy(update={"event_id": trajectory_event_id(request_id)})
        await self.bus.publish_event(self.subjects.trajectories, event)
        lease = self.core.finish(trajectory)
        if lease is not None:
            await lease.ack()
        self._room.set()

    # ------------------------------------------------------------------ intake

    async def _puller(self, version: int) -> Puller:
        if version not in self._pullers:
            spec = request_queue_spec(self.subjects, version, self.config.queue_ack_wait_s)
            consumer = await self.bus.consumer(spec)
            self._pullers[version] = Puller(consumer, f"generator:{self.config.engine_id}")
        return self._pullers[version]

    async def _pull_loop(self) -> None:
        """Fetch at most the core's room, and sleep on ``_room`` otherwise: a busy engine
        leaves its version's queue to the other replicas."""
        while True:
            version, room = self.core.assigned, self.core.room()
            if version is None or room <= 0:
                await self._room.wait()
                self._room.clear()
                continue
            if self.core.backlog and await self._pull_backlog(version, room):
                self._wake.set()
                continue
            puller = await self._puller(version)
            msgs = await puller.fetch(room, self.config.fetch_timeout_s)
            for msg in msgs:
                await self._admit(msg, version)
            if msgs:
                self._wake.set()

    async def _pull_backlog(self, version: int, room: int) -> bool:
        """Partial rollout: take requests still queued under older versions first (they were
        dispatched earlier, or come back from a crashed engine). A version is forgotten once
        its queue is settled (nothing queued or unacked) and it is two versions old."""
        for old in sorted(self.core.backlog):
            if old >= version:
                self.core.backlog.discard(old)
                continue
            puller = await self._puller(old)
            state = await puller.consumer.state()
            if state.depth == 0 and old < version - 1:
                self.core.backlog.discard(old)
            if state.depth == 0:
                continue
            # A request handed back (nak) is "delivered" to NATS, not pending: it shows only in
            # the depth, mixed with requests engines hold. Look for it with a short fetch.
            wait = self.config.fetch_timeout_s / (10 if state.pending else 100)
            msgs = await puller.fetch(room, wait)
            for msg in msgs:
                await self._admit(msg, version, old)
            if msgs:
                return True
        return False

    async def _admit(self, msg: Message, version: int, queue: int | None = None) -> None:
        request, reason = parse_event(RolloutRequest, msg.data)
        if request is None:
            await self._dead_letter(msg, reason)
            return
        try:
            if self.episodes is not None:
                admitted = await self.episodes.open(request, msg, version, queue)
            else:
                admitted = await self.core.admit(request, msg, version, queue)
        except EngineError as exc:
            await self._dead_letter(msg, f"{type(exc).__name__}: {exc}")
            return
        if admitted == "not_ours":
            await msg.nak()
        elif admitted == "renewed":
            self._log.info("request_lease_renewed", request=request.request_id)

    async def _dead_letter(self, msg: Message, reason: str) -> None:
        if await dead_letter(self.bus, msg, f"generator:{self.config.engine_id}", reason):
            self.core.stats.dead_lettered += 1
            self._log.warning("request_dead_lettered", reason=reason[:300])

    async def _release_loop(self) -> None:
        """Hand back requests buffered for queues this engine does not pull now.

        A fetch can return while messages its pull requests asked for are still arriving; only
        a later fetch on that queue takes them. An engine moved to another version makes none,
        so they would sit unacked and unserved until the ack wait (30 s) expires: a live run
        stalled 29 s on 29 such requests. Checked every status interval (they may arrive just
        after the switch); the queue being pulled, and partial rollout's backlog, are left.
        """
        while True:
            await asyncio.sleep(self.config.status_interval_s)
            serving = self.core.serving
            for version, puller in list(self._pullers.items()):
                if (serving and version == self.core.assigned) or version in self.core.backlog:
                    continue
                released = await puller.consumer.release_buffered()
                if released:
                    self._log.info("buffered_requests_released", version=version, count=released)

    # ------------------------------------------------------------------ control

    async def _control(self, data: bytes) -> bytes:
        """One ``ControlReply`` per command; a bad or failing one gets ``ok=False`` with the
        reason and never kills the engine loop."""
        try:
            reply = await self._apply(_COMMANDS.validate_json(data))
        except (ValidationError, EngineError, KeyError) as exc:
            reply = ControlReply(ok=False, error=f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            self._log.exception("control_failed")
            reply = ControlReply(ok=False, error=f"{type(exc).__name__}: {exc}")
        self._wake.set()
        self._room.set()
        return reply.model_dump_json().encode()

    async def _apply(self, command: Any) -> ControlReply:
        core = self.core
        match command:
            case AssignVersion(version=version):
                previous = core.assigned
                await core.assign(version)
                self._log.info("assigned", version=version, previous=previous)
            case Drain():
                core.drain()
            case Prioritize(request_ids=ids, priority=priority):
                await core.prioritize(ids, priority)
            case ExportRequest(request_id=rid, blob_name=blob_name):
                snapshot, lease = await core.export(rid)
                try:
                    blob = await self.bus.put_blob(blob_name, snapshot)
                except Exception:
                    await core.restore_exported(rid)
                    raise
                return ControlReply(ok=True, blob=blob, lease=lease, kv_bytes=len(snapshot))
            case ImportRequest(blob=blob, lease=lease):
                snapshot = await self.bus.get_blob(blob.name)
                rid = await core.import_(snapshot, self.bus.lease(lease))
                if self.episodes is not None:
                    await self.episodes.adopt(rid)
                return ControlReply(ok=True, kv_bytes=len(snapshot))
            case ReleaseExported(request_id=rid):
                await core.release_exported(rid)
                if self.episodes is not None:
                    self.episodes.forget(rid)
            case RestoreExported(request_id=rid):
                await core.restore_exported(rid)
                if self.episodes is not None:
                    await self.episodes.catch_up(rid)
            case _:
                return ControlReply(ok=False, error=f"unsupported command {type(command).__name__}")
        return ControlReply(ok=True)

    # ------------------------------------------------------------------ on a clock

    async def _report_status(self) -> None:
        """The orchestrator decides from ``EngineStatus`` (assignment, state, KV use)."""
        while True:
            await self.bus.publish_event(
                self.subjects.status(self.config.engine_id), await self.core.status()
            )
            await asyncio.sleep(self.config.status_interval_s)

    async def _heartbeat(self) -> None:
        """Beat held leases well within the ack wait (or live requests would be redelivered and
        generated twice), and restore exports the migrator abandoned."""
        interval = min(self.config.heartbeat_interval_s, self.config.queue_ack_wait_s / 3)
        while True:
            await asyncio.sleep(interval)
            for lease in self.core.leases():
                await lease.in_progress()
            for rid in await self.core.reclaim_stale_exports():
                self._log.warning("stale_export_restored", request=rid)
                if self.episodes is not None:
                    await self.episodes.catch_up(rid)
                self._wake.set()

    # ------------------------------------------------------------------ episodes

    async def _replies_loop(self, replies: Subscription, episodes: Episodes) -> None:
        """Every environment reply, live: the episodes held here act on theirs."""
        async for msg in replies:
            reply, _ = parse_event(EnvReply, msg.data)
            if reply is not None:  # a malformed one is the environment stage's to answer for
                await episodes.reply(reply)

    async def _episode_clock(self, episodes: Episodes) -> None:
        while True:
            await asyncio.sleep(min(1.0, episodes.config.reply_timeout_s / 4))
            await episodes.check_deadlines()
