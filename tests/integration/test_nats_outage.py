"""A run rides out a NATS server that goes away: the embedded server SIGKILLed mid-run is
restarted on its port and store, an external one stopped for a while is waited for, and a
server that stays away fails the calls with a message naming NATS and the URL."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dora.bus import NatsBus
from dora.bus.outage import BusUnavailable
from dora.bus.server import NatsServer
from dora.events import Event, Prompt
from dora.pipeline import Pipeline
from dora.stage import Context, Stage, derived_id
from dora.stages.counting_sink import CountingSink
from dora.stages.rule_generator import RuleGenerator
from dora.stages.verifier import VerifierStage
from dora.subjects import Subjects
from dora.tasks import make_task

pytestmark = [pytest.mark.nats, pytest.mark.skipif(sys.platform != "linux", reason="signals")]

HALF = 40


class TwoHalves(Stage):
    """Publishes HALF prompts, waits for ``gate``, then publishes HALF more."""

    name = "prompts"
    emits = {Prompt: "prompts"}
    finite = True

    def __init__(self, gate: asyncio.Event) -> None:
        super().__init__()
        self.gate = gate

    async def produce(self, ctx: Context) -> AsyncIterator[Event]:
        for i, prompt in enumerate(make_task("arithmetic").prompts("train", 2 * HALF, 0)):
            if i == HALF:
                await self.gate.wait()
            yield prompt.model_copy(update={"event_id": derived_id("prompt", prompt.prompt_id)})


def echo_pipeline(gate: asyncio.Event, **kwargs: object) -> tuple[Pipeline, CountingSink]:
    pipeline = Pipeline(**kwargs)  # type: ignore[arg-type]
    sink = CountingSink(expect=2 * HALF)
    for stage in (sink, VerifierStage(verifier="exact_match"), RuleGenerator(), TwoHalves(gate)):
        pipeline.add(stage)
    return pipeline, sink


async def until(condition: object, timeout: float = 60.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.05)


async def test_the_embedded_server_sigkilled_mid_run_is_restarted_and_the_run_completes(
    tmp_path: Path,
) -> None:
    gate = asyncio.Event()
    pipeline, sink = echo_pipeline(gate, run_id="outage-embedded", run_dir=tmp_path / "run")
    run = asyncio.create_task(pipeline.run())
    try:
        await until(lambda: len(sink.seen) >= HALF)
        server = pipeline._server
        assert server is not None and server.pid is not None
        first_pid = server.pid
        os.kill(first_pid, signal.SIGKILL)
        await until(lambda: pipeline.server_restarts == 1 and server.running)
        assert server.pid != first_pid
        gate.set()  # the second half is published to the restarted server
        summary = await asyncio.wait_for(run, timeout=120)
    finally:
        if not run.done():
            run.cancel()
    assert summary["completed"]
    assert len(sink.seen) == 2 * HALF  # every prompt counted once, none lost in the restart


async def test_an_external_server_stopped_for_a_while_is_waited_for(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats").start()
    gate = asyncio.Event()
    pipeline, sink = echo_pipeline(
        gate, run_id="outage-external", nats_url=server.url, run_dir=tmp_path / "run"
    )
    run = asyncio.create_task(pipeline.run())
    try:
        await until(lambda: len(sink.seen) >= HALF)
        await asyncio.to_thread(server.stop)
        gate.set()  # the source publishes into the outage: its publishes wait for the server
        await asyncio.sleep(12)  # longer than a JetStream call's 10 s timeout
        assert not run.done(), "the run gave up during the outage"
        server.spawn()
        await asyncio.to_thread(server.wait_ready)
        summary = await asyncio.wait_for(run, timeout=120)
    finally:
        if not run.done():
            run.cancel()
        server.stop()
    assert summary["completed"]
    assert len(sink.seen) == 2 * HALF


async def test_a_server_that_stays_away_fails_with_nats_and_the_url(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats").start()
    bus = NatsBus(Subjects("outage-gone"), server.url, outage_s=2.0)
    await bus.connect()
    try:
        await bus.kv_put("k", b"v")
        server.stop()
        with pytest.raises(BusUnavailable, match=rf"NATS at {server.url} unreachable for \d+ s"):
            await bus.kv_get("k")
    finally:
        await bus.close()
