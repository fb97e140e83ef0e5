"""What the rollout's service stages share: run their services as tasks, fail when one fails.

A service stage (dispatcher, generator, orchestrator) is a source whose work is a long-running
service on the bus rather than events its runner hands it. Its ``produce`` waits on the
services: one that fails fails the stage (so the run stops, or ``--processes`` restarts the
process); NATS redelivers what it left unacknowledged.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import Any

import structlog

from dora.events import Event
from dora.stage import Context, Stage

log = structlog.get_logger(__name__)

STOP_TIMEOUT_S = 30.0


class Services:
    """The tasks of one stage's services, started and stopped together."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[Any]] = []
        self._stops: list[Callable[[], None]] = []

    def start(self, name: str, run: Coroutine[Any, Any, Any], stop: Callable[[], None]) -> None:
        self.tasks.append(asyncio.create_task(run, name=name))
        self._stops.append(stop)

    async def watch(self) -> None:
        """Until stopped: raise the first service's failure."""
        pending = set(self.tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    raise RuntimeError(f"{task.get_name()} failed") from task.exception()
        await asyncio.Event().wait()  # every service returned: serve until the pipeline stops

    async def until(self, events: Iterable[asyncio.Event]) -> None:
        """Until every event is set (services ready); raise if a service fails first."""
        ready = asyncio.ensure_future(asyncio.gather(*(e.wait() for e in events)))
        failed = asyncio.ensure_future(self.watch())
        await asyncio.wait({ready, failed}, return_when=asyncio.FIRST_COMPLETED)
        for task in (ready, failed):
            task.cancel()
        if failed.done() and not failed.cancelled():
            failed.result()

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Ask each service to stop, wait up to ``timeout``, then cancel the stuck ones."""
        for stop in self._stops:
            stop()
        if not self.tasks:
            return
        _, pending = await asyncio.wait(self.tasks, timeout=timeout)
        for task in pending:
            log.error("service_stuck", service=task.get_name())
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks, self._stops = [], []


class ServiceStage(Stage):
    """A stage whose work is its services (started in ``setup`` with ``self.services.start``):
    ``produce`` waits on them and fails with the first that fails, ``teardown`` stops them."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.services = Services()

    async def produce(self, ctx: Context) -> AsyncIterator[Event]:
        await self.services.watch()
        yield  # pragma: no cover - makes this an async generator

    async def teardown(self, ctx: Context) -> None:
        await self.services.stop()
