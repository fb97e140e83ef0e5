"""``dora tail`` on a real nats-server: renders events, flags invalid ones, consumes nothing."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from dora.bus import BusError, ConsumerSpec, NatsBus
from dora.bus.auth import RunCredentials
from dora.bus.server import NatsServer
from dora.cli import app
from dora.cli.tail_cmd import find_auth, find_url, render, tail
from dora.events import EngineStatus
from dora.subjects import Subjects
from tests.unit.test_schemas import trajectory


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=300, color_system=None), out


async def test_tail_from_start_renders_events_and_flags_invalid(
    nats_bus: NatsBus, nats_server: NatsServer, run_id: str
) -> None:
    subject = nats_bus.subjects.trajectories
    await nats_bus.consumer(ConsumerSpec("learner", subject))  # interest: the stream keeps them
    for i in range(2):
        await nats_bus.publish_event(subject, trajectory(i))
    await nats_bus.publish(subject, b'{"not": "an event"}', msg_id="bad")

    console, out = _console()
    count = await tail(
        nats_server.url, "trajectories", run_id, from_start=True, max_count=3, console=console
    )
    lines = out.getvalue().splitlines()
    assert count == 3 and len(lines) == 3
    for i, line in enumerate(lines[:2]):
        assert line.startswith(f"#{i + 1} {subject} Trajectory")
        assert f"request=r{i}" in line and "version=3" in line and "tokens=4+30" in line
    assert "INVALID" in lines[2] and '{"not": "an event"}' in lines[2]


async def test_tail_of_a_work_queue_consumes_nothing(
    nats_bus: NatsBus, nats_server: NatsServer, run_id: str
) -> None:
    subject = nats_bus.subjects.requests(2)
    consumer = await nats_bus.consumer(ConsumerSpec("gen-v2", subject))
    sent = [trajectory(i).request for i in range(3)]
    for request in sent:
        await nats_bus.publish_event(subject, request)
    console, out = _console()
    await tail(nats_server.url, "requests", run_id, from_start=True, max_count=3, console=console)
    assert out.getvalue().count("RolloutRequest") == 3
    got = await consumer.fetch(batch=10, timeout=2.0)
    assert [m.msg_id for m in got] == [r.event_id for r in sent]


async def test_tail_live_shows_only_new_messages(
    nats_bus: NatsBus, nats_server: NatsServer, run_id: str
) -> None:
    subject = nats_bus.subjects.metrics
    await nats_bus.publish(subject, b"old", msg_id="old")  # limits stream: kept, but not new
    console, out = _console()
    task = asyncio.create_task(
        tail(nats_server.url, "metrics", run_id, raw=True, max_count=1, console=console)
    )
    i = 0
    while not task.done():  # the tail starts at some point: keep offering new messages
        await nats_bus.publish(subject, f"new{i}".encode(), msg_id=f"new{i}")
        i += 1
        await asyncio.wait({task}, timeout=0.1)
    assert task.result() == 1
    assert "new" in out.getvalue() and "old" not in out.getvalue()


async def test_tail_live_subject(nats_bus: NatsBus, nats_server: NatsServer, run_id: str) -> None:
    console, out = _console()
    task = asyncio.create_task(
        tail(nats_server.url, "status", run_id, max_count=1, console=console)
    )
    status = EngineStatus(engine_id="e7", version=2, state="serving", running=3)
    while not task.done():  # live subjects are only seen while subscribed
        await nats_bus.publish_event(nats_bus.subjects.status("e7"), status)
        await asyncio.wait({task}, timeout=0.1)
    line = out.getvalue()
    assert "EngineStatus" in line and "engine_id=e7" in line and "running=3" in line


def test_cli_tail_full_subject_raw(nats_server: NatsServer, run_id: str) -> None:
    subjects = Subjects(run_id)

    async def publish() -> str:
        async with NatsBus(subjects, nats_server.url) as bus:
            event = trajectory(5)
            await bus.publish_event(subjects.weights, event)  # a limits stream keeps it
            return event.event_id

    event_id = asyncio.run(publish())
    result = CliRunner().invoke(
        app,
        [
            "tail",
            subjects.weights,
            "--nats",
            nats_server.url,
            "--from-start",
            "--raw",
            "--max",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    payload = result.output[result.output.index("{") :].replace("\n", "")
    assert json.loads(payload)["event_id"] == event_id


def test_cli_tail_bad_input_is_named(nats_server: NatsServer, run_id: str) -> None:
    runner = CliRunner()
    unknown = runner.invoke(app, ["tail", "bogus", "--run", run_id, "--nats", nats_server.url])
    assert unknown.exit_code != 0 and "bogus" in unknown.output
    no_run = runner.invoke(app, ["tail", "scored", "--nats", nats_server.url])
    assert no_run.exit_code != 0 and "--run" in no_run.output


def test_find_url_reads_the_runs_embedded_server(tmp_path: Path) -> None:
    with NatsServer(tmp_path / "runs" / "r1" / "nats") as server:
        assert find_url(None, "r1", tmp_path / "runs") == server.url
    with pytest.raises(Exception, match="no running nats-server"):
        find_url(None, "r1", tmp_path / "runs")


def test_render_raw_keeps_payload() -> None:
    line = render("dora.r.scored", b"\xffbroken", "scored", seq=9)
    assert "INVALID" in line.plain and line.plain.startswith("#9 dora.r.scored")


async def test_tail_ends_with_an_error_when_the_server_goes_away(tmp_path: Path) -> None:
    import nats.errors

    server = NatsServer(tmp_path / "nats").start()
    subjects = Subjects("gone")
    async with NatsBus(subjects, server.url) as bus:
        await bus.publish(subjects.metrics, b"m0", msg_id="m0")
    console, out = _console()
    task = asyncio.create_task(
        tail(server.url, "metrics", "gone", from_start=True, raw=True, console=console)
    )
    while "m0" not in out.getvalue():  # it is following the stream
        await asyncio.wait({task}, timeout=0.05)
    server.stop()
    with pytest.raises((OSError, nats.errors.Error)):
        await asyncio.wait_for(task, timeout=60.0)


def test_cli_tail_without_a_server_says_so(tmp_path: Path) -> None:
    from dora.bus.server import free_port

    url = f"nats://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(app, ["tail", "scored", "--run", "r", "--nats", url])
    assert result.exit_code == 1
    assert "unreachable or gone" in result.output


async def test_tail_of_an_embedded_run_logs_in_read_only_from_the_run_folder(
    tmp_path: Path,
) -> None:
    runs = tmp_path / "runs"
    creds = RunCredentials.load_or_create(runs / "r1", "r1")
    authorization = creds.server_authorization()
    with NatsServer(runs / "r1" / "nats", authorization=authorization) as server:
        subjects = Subjects("r1")
        async with NatsBus(subjects, server.url, auth=creds.auth("pipeline")) as bus:
            await bus.publish(subjects.metrics, b"m0", msg_id="m0")
        auth = find_auth(None, "r1", runs, embedded=True)
        assert auth is not None and auth.user == "reader"
        console, out = _console()
        count = await tail(
            server.url,
            "metrics",
            "r1",
            from_start=True,
            raw=True,
            max_count=1,
            console=console,
            auth=auth,
        )
        assert count == 1 and "m0" in out.getvalue()
        with pytest.raises(BusError, match="refused the login of an anonymous client"):
            await tail(server.url, "metrics", "r1", from_start=True, max_count=1, console=console)
