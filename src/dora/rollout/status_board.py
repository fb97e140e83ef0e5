"""The one watcher of engine status: the newest ``EngineStatus`` of every engine, and when.

Generators publish their status on the live ``status.<engine>`` subjects every fraction of a
second; the dispatcher, the orchestrator and the baseline controller each keep a board of
them. Exactly one reader, the one that acts on the fleet (``owner``), dead-letters a message
that is not an ``EngineStatus``, so each bad message leaves one dead letter; the others skip it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog

from dora.bus import Bus, Subscription
from dora.events import EngineStatus
from dora.stage.deadletter import dead_letter, parse_event

log = structlog.get_logger(__name__)


class StatusBoard:
    """``await start()``, read ``latest`` / ``seen`` / ``live()``, ``await close()``."""

    def __init__(
        self, bus: Bus, owner: str | None = None, on_change: Callable[[], None] | None = None
    ) -> None:
        """``on_change``: called when an engine's assignment changes or a new engine shows."""
        self.bus = bus
        self.owner = owner
        self.on_change = on_change
        self.latest: dict[str, EngineStatus] = {}
        self.seen: dict[str, float] = {}
        """``time.monotonic()`` of each engine's newest status."""
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(self.bus.subjects.status_all)
        self._task = asyncio.create_task(self._watch(self._sub))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sub is not None:
            await self._sub.unsubscribe()

    def live(self, now: float, timeout_s: float) -> dict[str, EngineStatus]:
        """Engines heard from within ``timeout_s`` of ``now``, by id."""
        return {e: st for e, st in sorted(self.latest.items()) if now - self.seen[e] <= timeout_s}

    def assume(self, engine_id: str, **fields: object) -> None:
        """A command's effect on our copy until the engine's next status confirms it."""
        if engine_id in self.latest:
            self.latest[engine_id] = self.latest[engine_id].model_copy(update=fields)

    async def _watch(self, sub: Subscription) -> None:
        async for msg in sub:
            status, reason = parse_event(EngineStatus, msg.data)
            if status is None:
                if self.owner is not None:
                    log.warning("status_rejected", stage=self.owner, reason=reason[:300])
                    await dead_letter(self.bus, msg, self.owner, reason)
                continue
            previous = self.latest.get(status.engine_id)
            self.latest[status.engine_id] = status
            self.seen[status.engine_id] = time.monotonic()
            changed = previous is None or previous.assigned_version != status.assigned_version
            if changed and self.on_change is not None:
                self.on_change()
