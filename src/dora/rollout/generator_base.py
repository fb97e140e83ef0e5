"""The state every part of a generator shares: the engine, its worker thread, held leases.

The generator is assembled from small parts (request intake, control commands, migration,
status) that each live in their own module; they all read and write the same few fields, so
those fields and the helpers around them are defined once here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from dora.bus import Bus, Message
from dora.engines.base import Engine
from dora.events import RolloutRequest
from dora.rollout.generator_config import GeneratorConfig, GeneratorStats, WeightSource

log = structlog.get_logger("dora.rollout.generator")
T = TypeVar("T")


@dataclass
class Held:
    """A request the engine holds, and the lease on its queue message."""

    lease: Message
    exported: bool = False
    exported_at: float = 0.0


class GeneratorBase:
    """Shared fields and helpers of ``Generator``; not used on its own."""

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
        self._held: dict[str, Held] = {}
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

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run an engine call on the engine's own thread (the engine is single-threaded)."""
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
