"""Request intake: pull ``RolloutRequest``s only while the engine has room.

Backpressure is the pull itself: the loop fetches at most ``max_running`` minus what the
engine holds, and sleeps on ``_room`` otherwise, so a busy engine leaves its version's work
queue to the other replicas. A request that cannot be served goes to the dead-letter subject
with the reason; one that is merely no longer ours (reassigned mid-fetch) is handed back.
"""

from __future__ import annotations

import asyncio
from typing import Any

from dora.bus import Message
from dora.engines.base import EngineError
from dora.events import RolloutRequest
from dora.rollout.generator_base import GeneratorBase, Held
from dora.rollout.generator_config import request_queue_spec
from dora.rollout.partial import retag
from dora.stage.deadletter import build_dead_letter, parse_event


class RequestIntake(GeneratorBase):
    """The pull loop of ``Generator`` (see module docstring)."""

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
            serving = self.engine.version == self.assigned and not self.draining
            for version, consumer in list(self._consumers.items()):
                if (serving and version == self.assigned) or version in self._backlog:
                    continue
                released = await consumer.release_buffered()
                if released:
                    self._log.info("buffered_requests_released", version=version, count=released)

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
            if state.depth == 0:
                continue
            # A request handed back (nak) is "delivered" to NATS, not pending: it shows only in
            # the depth, mixed with requests engines hold. Look for it with a short fetch.
            wait = self.config.fetch_timeout_s / (10 if state.pending else 100)
            msgs = await consumer.fetch(batch=room, timeout=wait)
            for msg in msgs:
                await self._admit(msg, version, old)
            if msgs:
                return True
        return False

    async def _admit(self, msg: Message, version: int, queue: int | None = None) -> None:
        """Add a pulled request (from ``version``'s queue, or an older ``queue`` in partial
        rollout, where it is retagged to ``version``)."""
        request, reason = parse_event(RolloutRequest, msg.data)
        if request is None:
            await self._dead_letter(msg, reason)
            return
        try:
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
            held = self._held.get(request.request_id)
            if held is not None and not held.exported:
                # Redelivered while we still generate it (its lease lapsed: heartbeats could
                # not reach the server, e.g. during a NATS outage). The new delivery is the live
                # lease; the request keeps running here, once.
                held.lease = msg
                self.stats.rebound += 1
                self._log.info("request_lease_renewed", request=request.request_id)
                return
            if queue is not None:
                request = retag(request, version)
            await self._call(self.engine.add_request, request)
        except EngineError as exc:
            await self._dead_letter(msg, f"{type(exc).__name__}: {exc}")
            return
        self._held[request.request_id] = Held(msg)
        self.stats.pulled += 1

    async def _dead_letter(self, msg: Message, reason: str) -> None:
        letter = await build_dead_letter(
            self.bus, msg, f"generator:{self.config.engine_id}", reason
        )
        await self.bus.publish_event(self.subjects.deadletter, letter)
        await msg.term()
        self.stats.dead_lettered += 1
        self._log.warning("request_dead_lettered", reason=reason)
