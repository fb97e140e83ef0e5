"""The generator core's admission against a weight load running on the engine thread."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from dora.engines.base import EngineError, VersionMismatch
from dora.learner.synthetic import make_scored
from dora.rollout.generator_config import GeneratorConfig
from dora.rollout.generator_core import GeneratorCore


class LoadingEngine:
    """Just enough engine: a version, a weight load that waits to be let through, requests."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.requests: list[Any] = []
        self.release = threading.Event()

    def load_weights(self, version: int, weights: Any) -> None:
        self.release.wait(timeout=30)
        self.version = version

    def add_request(self, request: Any) -> None:
        if request.version != self.version:
            raise VersionMismatch(f"v{request.version} request on a v{self.version} engine")
        self.requests.append(request)


async def test_a_request_pulled_while_other_weights_load_is_handed_back() -> None:
    # The orchestrator assigned v35, the engine began loading it, then assigned v34 back: the
    # event loop still reads version 34 while the thread loads 35.
    engine = LoadingEngine(version=34)
    core = GeneratorCore(engine, GeneratorConfig(engine_id="e0", initial_version=34))  # type: ignore[arg-type]
    loading = asyncio.ensure_future(core.call(engine.load_weights, 35, None))
    request = make_scored(group_id="g", group_index=0, group_size=1, version=34).trajectory.request
    admitting = asyncio.ensure_future(core.admit(request, lease=object(), version=34))  # type: ignore[arg-type]
    await asyncio.sleep(0)  # admit has passed its event-loop check and waits for the thread
    engine.release.set()
    await loading
    assert await admitting == "not_ours"  # handed back to its queue, not dead-lettered
    assert engine.requests == [] and core.held == {}
    core.close()


def test_parked_episodes_free_their_decode_slot_up_to_max_parked() -> None:
    from dora.rollout.generator_core import Held

    engine = LoadingEngine(version=0)
    config = GeneratorConfig(engine_id="e0", initial_version=0, max_running=4, max_parked=3)
    core = GeneratorCore(engine, config)  # type: ignore[arg-type]
    core.state = "serving"
    for i in range(4):
        core.held[f"r{i}"] = Held(lease=object())  # type: ignore[arg-type]
    assert core.room() == 0
    core.parked |= {"r0", "r1"}  # their environment is running a tool
    assert core.room() == 2
    core.opening["r9"] = Held(lease=object())  # type: ignore[arg-type]
    assert core.room() == 1
    core.parked.add("r2")
    assert core.room() == 2  # 2 decoding: 2 slots, but 5 held of 4 + 3
    core.parked.add("r3")
    assert core.room() == 2  # the parked cap binds: 7 - 5


async def test_an_engine_finishing_an_old_tail_imports_more_of_it_but_not_while_draining() -> None:
    """Consolidation packs short tails into an engine already assigned the newest version
    that still finishes the old one: the import goes through (the engine checks the snapshot's
    version); a draining engine (scale-down, stop) takes nothing."""

    class ImportingEngine(LoadingEngine):
        def import_request(self, snapshot: bytes) -> str:
            if int(snapshot.decode()) != self.version:
                raise VersionMismatch("snapshot of another version")
            self.requests.append(snapshot)
            return f"r{len(self.requests)}"

    engine = ImportingEngine(version=3)
    core = GeneratorCore(engine, GeneratorConfig(engine_id="e0", initial_version=3))  # type: ignore[arg-type]
    core.state = "serving"
    await core.assign(4)  # switching: v3's tail runs until it ends or moves
    assert await core.import_(b"3", lease=object()) == "r1"  # type: ignore[arg-type]
    core.drain()
    with pytest.raises(EngineError, match="not serving"):
        await core.import_(b"3", lease=object())  # type: ignore[arg-type]
    assert engine.requests == [b"3"]
    core.close()
