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

This module holds the step loop and weight loads; the other parts live beside it:
``generator_config`` (config, queue spec), ``generator_base`` (shared state),
``generator_intake`` (pulling), ``generator_control`` (commands), ``generator_migration``
(export / import) and ``generator_status`` (status and heartbeats).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from dora.aio import cancel_all
from dora.engines.base import EngineError, VersionMismatch
from dora.events import RolloutRequest, Trajectory
from dora.rollout.generator_config import (
    QUEUE_ACK_WAIT_S,
    QUEUE_MAX_DELIVER,
    GeneratorConfig,
    GeneratorStats,
    RolloutMode,
    WeightSource,
    request_queue_spec,
    trajectory_event_id,
)
from dora.rollout.generator_control import ControlHandler
from dora.rollout.generator_intake import RequestIntake
from dora.rollout.generator_status import StatusReporter
from dora.rollout.partial import retag

__all__ = [
    "QUEUE_ACK_WAIT_S",
    "QUEUE_MAX_DELIVER",
    "Generator",
    "GeneratorConfig",
    "GeneratorStats",
    "RolloutMode",
    "WeightSource",
    "request_queue_spec",
    "trajectory_event_id",
]


class Generator(ControlHandler, StatusReporter, RequestIntake):
    """Runs an ``Engine`` against the bus; ``await run()`` until ``stop()``."""

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
            asyncio.create_task(self._release_loop()),
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
        self.stats.reprefilled_tokens += trajectory.reprefilled_tokens
        self._room.set()
