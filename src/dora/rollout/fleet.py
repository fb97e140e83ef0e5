"""A rollout fleet in one process: dispatcher, N generators, and the mode's version controller.

The same assembly serves the main job (built-in torch engines), the emulated fleet (timing
engines) and the integration tests. Each component talks only through the bus, so the same
parts also run as separate processes or Ray actors; this class just starts and stops them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from dora.bus import Bus
from dora.engines.base import Engine
from dora.rollout.baseline_controller import BaselineController
from dora.rollout.dispatch_service import DispatchService
from dora.rollout.dispatcher import Dispatcher, DispatcherConfig, Tokenize
from dora.rollout.generator import Generator
from dora.rollout.generator_config import GeneratorConfig, RolloutMode, WeightSource
from dora.rollout.orchestrator_service import OrchestratorService, OrchestratorServiceConfig

log = structlog.get_logger(__name__)


@dataclass
class FleetConfig:
    """Mode, engines' pulling limits, dispatcher and orchestrator settings."""

    mode: RolloutMode = "dora"
    dispatcher: DispatcherConfig = field(default_factory=DispatcherConfig)
    generator: GeneratorConfig = field(default_factory=lambda: GeneratorConfig(engine_id="_"))
    orchestrator: OrchestratorServiceConfig = field(default_factory=OrchestratorServiceConfig)
    max_prompts: int | None = None


class RolloutFleet:
    """Start with ``async with RolloutFleet(...)``; components are exposed for inspection."""

    def __init__(
        self,
        bus: Bus,
        engines: Sequence[Engine],
        weights: WeightSource,
        config: FleetConfig,
        tokenize: Tokenize | None = None,
        engine_buses: Sequence[Bus] | None = None,
    ) -> None:
        """``engine_buses``: one client per generator, as separate processes would have (so
        one can lose its connection alone); by default they all share ``bus``."""
        if engine_buses is not None and len(engine_buses) != len(engines):
            raise ValueError(
                f"engine_buses: {len(engine_buses)} clients for {len(engines)} engines"
            )
        self.bus = bus
        self.config = config
        dispatcher_config = replace(config.dispatcher, mode=config.mode)
        self.dispatch = DispatchService(
            bus, Dispatcher(dispatcher_config, tokenize), max_prompts=config.max_prompts
        )
        self.generators = [
            Generator(
                engine,
                engine_buses[i] if engine_buses is not None else bus,
                weights,
                replace(
                    config.generator,
                    engine_id=engine.engine_id,
                    mode=config.mode,
                    initial_version=0,
                ),
            )
            for i, engine in enumerate(engines)
        ]
        self.controller: OrchestratorService | BaselineController
        # Controllers may create a version's queue consumer before any engine does: it must
        # carry the generators' ack wait (JetStream keeps the first definition).
        ack_wait = config.generator.queue_ack_wait_s
        if config.mode == "dora":
            self.controller = OrchestratorService(
                bus, replace(config.orchestrator, queue_ack_wait_s=ack_wait)
            )
        else:
            self.controller = BaselineController(
                bus,
                config.mode,
                queue_ack_wait_s=ack_wait,
                engine_timeout_s=config.orchestrator.engine_timeout_s,
            )
        self._tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(g.run(), name=g.config.engine_id) for g in self.generators
        ]
        await asyncio.gather(*(g.ready.wait() for g in self.generators))
        self._tasks.append(asyncio.create_task(self.dispatch.run(), name="dispatcher"))
        self._tasks.append(asyncio.create_task(self.controller.run(), name="controller"))
        log.info("fleet_started", mode=self.config.mode, engines=len(self.generators))

    async def stop(self) -> None:
        self.controller.stop()
        self.dispatch.stop()
        for g in self.generators:
            g.stop()
        _, pending = await asyncio.wait(self._tasks, timeout=30)
        for task in pending:
            log.error("fleet_component_stuck", component=task.get_name())
            task.cancel()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        for task, result in zip(self._tasks, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                log.error("fleet_component_failed", component=task.get_name(), error=repr(result))

    def failures(self) -> list[BaseException]:
        """Exceptions of components that died while the fleet runs (tests assert none)."""
        out = []
        for task in self._tasks:
            if task.done() and not task.cancelled():
                with contextlib.suppress(asyncio.InvalidStateError):
                    exc = task.exception()
                    if exc is not None:
                        out.append(exc)
        return out

    async def __aenter__(self) -> RolloutFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
