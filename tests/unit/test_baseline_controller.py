"""BaselineController: which engines it moves to the newest version, and how."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from dora.bus import MemoryBus
from dora.events import AssignVersion, ControlReply, EngineStatus
from dora.rollout.baseline_controller import BaselineController
from dora.subjects import Subjects

N = 4


def _status(engine: str, version: int) -> EngineStatus:
    return EngineStatus(
        engine_id=engine, version=version, assigned_version=version, state="serving"
    )


async def _partial_fleet_on_v0(
    bus: MemoryBus, handlers: dict[str, Callable[[bytes], Awaitable[bytes]]]
) -> BaselineController:
    """A partial-rollout controller that sees these engines serving v0 and v1 published;
    each engine's control subject answered by its handler."""
    for engine, handler in handlers.items():
        await bus.serve(bus.subjects.control(engine), handler)
    controller = BaselineController(bus, "partial")
    now = time.monotonic()
    for engine in handlers:
        controller.engines.latest[engine] = _status(engine, 0)
        controller.engines.seen[engine] = now
    controller.newest = 1
    return controller


async def test_partial_update_reaches_every_engine_at_once() -> None:
    """A partial-rollout update is fleet-wide: every engine's assignment is in flight
    together (each handler below returns only once all N have been entered), not one
    interrupt round trip after another."""
    bus = MemoryBus(Subjects("t"))
    await bus.connect()
    entered: list[str] = []
    all_in = asyncio.Event()
    saw_all: dict[str, bool] = {}

    def handler_for(engine: str) -> Callable[[bytes], Awaitable[bytes]]:
        async def handle(data: bytes) -> bytes:
            command = AssignVersion.model_validate_json(data)
            assert command.engine_id == engine and command.version == 1
            entered.append(engine)
            if len(entered) == N:
                all_in.set()
            try:
                await asyncio.wait_for(all_in.wait(), timeout=2.0)
                saw_all[engine] = True
            except TimeoutError:
                saw_all[engine] = False
            return ControlReply(ok=True).model_dump_json().encode()

        return handle

    engines = [f"e{i}" for i in range(N)]
    controller = await _partial_fleet_on_v0(bus, {e: handler_for(e) for e in engines})
    await controller.tick()
    assert sorted(entered) == engines
    assert all(saw_all[e] for e in engines)
    assert sorted(e for _, e, v in controller.assignments if v == 1) == engines
    assert all(controller.engines.latest[e].assigned_version == 1 for e in engines)
    entered.clear()
    await controller.tick()  # nothing left to move
    assert entered == []
    await bus.close()


async def test_an_assignment_the_engine_refuses_is_not_recorded() -> None:
    """The controller used to record an assignment without reading the reply: an engine that
    refused (busy loading, say) was then believed to serve the new version."""
    bus = MemoryBus(Subjects("t"))
    await bus.connect()
    replies = {
        "e0": ControlReply(ok=True),
        "e1": ControlReply(ok=False, error="loading weights"),
    }

    def handler_for(engine: str) -> Callable[[bytes], Awaitable[bytes]]:
        async def handle(data: bytes) -> bytes:
            AssignVersion.model_validate_json(data)
            return replies[engine].model_dump_json().encode()

        return handle

    controller = await _partial_fleet_on_v0(bus, {e: handler_for(e) for e in replies})
    await controller.tick()
    assert [(e, v) for _, e, v in controller.assignments] == [("e0", 1)]
    assert controller.engines.latest["e0"].assigned_version == 1
    assert controller.engines.latest["e1"].assigned_version == 0
