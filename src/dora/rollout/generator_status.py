"""What a generator sends on a clock: its status, and heartbeats on the leases it holds.

The orchestrator decides from ``EngineStatus`` (assignment, state, running requests, KV use),
so it is published every ``status_interval_s``. Held queue messages get in-progress
heartbeats well within the queue's ack wait, or live requests would be redelivered and
generated twice; the same beat reclaims exports the migrator abandoned.
"""

from __future__ import annotations

import asyncio

from dora.events import EngineStatus
from dora.rollout.generator_migration import MigrationSide


class StatusReporter(MigrationSide):
    """Periodic tasks of ``Generator`` (see module docstring)."""

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

    async def _report_status(self) -> None:
        while True:
            await self.bus.publish_event(
                self.subjects.status(self.config.engine_id), await self.status()
            )
            await asyncio.sleep(self.config.status_interval_s)

    async def _heartbeat(self) -> None:
        # Beat well within the ack wait, or live requests would be redelivered (regenerated
        # twice) when a short ack wait is configured for fast failover.
        interval = min(self.config.heartbeat_interval_s, self.config.queue_ack_wait_s / 3)
        while True:
            await asyncio.sleep(interval)
            for held in list(self._held.values()):
                await held.lease.in_progress()
            await self._reclaim_stale_exports()
