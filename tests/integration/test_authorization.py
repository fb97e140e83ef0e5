"""Who may publish what on a run's embedded nats-server: per-run logins, enforced by the server.

The embedded server admits no anonymous client. The pipeline's login may do everything of its
run; the reader login (outside consumers) reads and publishes nothing; the producer login
(outside producers) publishes prompts and nothing else. Every refusal here is the server's:
the forged message never reaches a stream, so no stage ever sees it.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from nats.js import api

from dora.bus import NatsBus, default_streams
from dora.bus.auth import NatsAuth, RunCredentials, StageGrant, stage_login
from dora.bus.server import NatsServer
from dora.events import ScoredTrajectory, Trajectory
from dora.subjects import Subjects

from ..fakes import fake_request
from .test_main_job import build_pipeline

pytestmark = pytest.mark.nats

RUN = "authrun"


class Client:
    """A plain nats-py client that remembers what the server refused it."""

    def __init__(self) -> None:
        self.refusals: list[str] = []
        self.changed = asyncio.Event()
        self.nc: Any = None

    async def connect(self, url: str, auth: NatsAuth | None = None) -> Client:
        async def on_error(exc: Exception) -> None:
            self.refusals.append(str(exc).lower())
            self.changed.set()

        options = auth.connect_options(url) if auth else {}
        self.nc = await nats.connect(
            url, allow_reconnect=False, connect_timeout=2, error_cb=on_error, **options
        )
        return self

    async def publish_refused(self, subject: str, payload: bytes = b"{}") -> bool:
        """True when the server refused the publish: it drops the message and tells this
        connection alone, asynchronously (the error may follow the flush's pong)."""
        before = len(self.refusals)
        await self.nc.publish(subject, payload)
        await self.nc.flush()
        return await self.refused_since(before, f'publish to "{subject.lower()}"')

    async def refused_since(self, before: int, what: str, within_s: float = 5.0) -> bool:
        """Whether the server reported refusing ``what`` after the first ``before`` refusals."""
        try:
            async with asyncio.timeout(within_s):
                while not any(what in r for r in self.refusals[before:]):
                    await self.changed.wait()
                    self.changed.clear()
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        await self.nc.close()


@pytest.fixture
async def secured(tmp_path: Path):
    """An embedded-style server with the run's logins, its streams made by the pipeline."""
    creds = RunCredentials.load_or_create(tmp_path / "run", RUN)
    server = NatsServer(tmp_path / "nats", authorization=creds.server_authorization()).start()
    streams = default_streams(replay=None)
    bus = NatsBus(Subjects(RUN), server.url, streams=streams, auth=creds.auth("pipeline"))
    await bus.connect()
    try:
        yield server, creds, bus
    finally:
        await bus.close()
        server.stop()


async def test_no_login_or_a_wrong_password_is_refused(secured: Any) -> None:
    server, _, _ = secured
    for auth in (None, NatsAuth(user="pipeline", password="guess"), NatsAuth(user="nobody")):
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await Client().connect(server.url, auth)
    files = sorted(p.name for p in (server.store_dir.parent / "run" / "credentials").iterdir())
    assert files == ["pipeline.json", "producer.json", "reader.json"]
    for name in files:
        mode = (server.store_dir.parent / "run" / "credentials" / name).stat().st_mode
        assert mode & 0o077 == 0, f"{name} is readable by others"
    assert (server.store_dir / "nats.conf").stat().st_mode & 0o077 == 0


async def test_producer_publishes_prompts_and_nothing_else(secured: Any) -> None:
    server, creds, bus = secured
    s = bus.subjects
    producer = await Client().connect(server.url, creds.auth("producer"))
    try:
        ack = await producer.nc.jetstream().publish(s.prompts, b'{"prompt_id": "p"}')
        assert ack.stream == s.stream("prompts")
        for subject in (s.scored, s.trajectories, s.weights, s.metrics, s.requests(0)):
            assert await producer.publish_refused(subject), subject
        assert await producer.publish_refused(f"$KV.{s.kv_bucket}.ledger")
        assert (await bus.stream_info(s.scored)).messages == 0
    finally:
        await producer.close()


async def test_reader_reads_everything_and_can_take_or_write_nothing(secured: Any) -> None:
    server, creds, bus = secured
    s = bus.subjects
    await bus.publish(s.prompts, b'{"prompt_id": "p"}', msg_id="p")
    await bus.kv_put("ledger", b'{"learner_step": 3}')
    reader = await Client().connect(server.url, creds.auth("reader"))
    try:
        js = reader.nc.jetstream(timeout=1)
        stored = await js.get_msg(s.stream("prompts"), 1)  # read by sequence: takes nothing
        assert stored.data == b'{"prompt_id": "p"}'
        ledger = await (await js.key_value(s.kv_bucket)).get("ledger")
        assert json.loads(ledger.value) == {"learner_step": 3}
        live = await reader.nc.subscribe(s.metrics)
        await reader.nc.flush()
        await bus.publish(s.metrics, b'{"step": 0}', msg_id="m0")
        assert (await live.next_msg(timeout=5)).data == b'{"step": 0}'

        for subject in (s.prompts, s.scored, s.weights, s.deadletter, f"$KV.{s.kv_bucket}.x"):
            assert await reader.publish_refused(subject), subject
        # a consumer on the pipeline's streams would take its work or hold its retention
        with pytest.raises(TimeoutError):
            await js.pull_subscribe(s.prompts, durable="steal", stream=s.stream("prompts"))
        assert (await bus.stream_info(s.prompts)).consumers == 0
        # control and rpc: a reader must not answer (or see) the fleet's requests
        before = len(reader.refusals)
        await reader.nc.subscribe(s.rpc("any"))
        await reader.nc.flush()
        assert await reader.refused_since(before, f'subscription to "{s.rpc("any")}"')
    finally:
        await reader.close()


async def test_a_stage_login_writes_only_what_its_stage_declares(tmp_path: Path) -> None:
    """As the verifier: scored yes; weights, metrics, trajectories, another stage's KV key,
    deleting a stream no."""
    creds = RunCredentials.load_or_create(tmp_path / "run", RUN, ["verifier"])
    grant = StageGrant(frozenset({"scored", "deadletter"}), ("sink.verifier.>",))
    authorization = creds.server_authorization({"verifier": grant})
    with NatsServer(tmp_path / "nats", authorization=authorization) as server:
        s = Subjects(RUN)
        bus = NatsBus(s, server.url, streams=default_streams(), auth=creds.auth("pipeline"))
        await bus.connect()
        await bus.kv_put("ledger", b"{}")
        verifier = await Client().connect(server.url, creds.auth(stage_login("verifier")))
        try:
            js = verifier.nc.jetstream(timeout=2)
            assert (await js.publish(s.scored, b"{}")).stream == s.stream("scored")
            kv = await js.key_value(s.kv_bucket)
            await kv.put("sink.verifier.counted", b"1")
            for subject in (s.weights, s.metrics, s.trajectories, s.requests(0), s.prompts):
                assert await verifier.publish_refused(subject), subject
            assert await verifier.publish_refused(f"$KV.{s.kv_bucket}.ledger")
            before = len(verifier.refusals)
            with pytest.raises(TimeoutError):
                await js.delete_stream(s.stream("scored"))
            assert await verifier.refused_since(before, "stream.delete")
            assert (await bus.stream_info(s.scored)).last_seq == 1  # still there, untouched
        finally:
            await verifier.close()
            await bus.close()


async def test_reader_attaches_its_own_consumer_to_the_replay_stream(tmp_path: Path) -> None:
    creds = RunCredentials.load_or_create(tmp_path / "run", RUN)
    with NatsServer(tmp_path / "nats", authorization=creds.server_authorization()) as server:
        from dora.stages.replay_writer import ReplaySettings

        streams = default_streams(replay=ReplaySettings(families=["scored"]).limits)
        bus = NatsBus(Subjects(RUN), server.url, streams=streams, auth=creds.auth("pipeline"))
        await bus.connect()
        reader = await Client().connect(server.url, creds.auth("reader"))
        try:
            s = bus.subjects
            await bus.publish(s.replay("scored"), b'{"n": 1}', msg_id="r1")
            sub = await reader.nc.jetstream(timeout=2).pull_subscribe(
                s.replay("scored"),
                durable="outside",
                stream=s.stream("replay"),
                config=api.ConsumerConfig(ack_policy=api.AckPolicy.EXPLICIT),
            )
            (msg,) = await sub.fetch(1, timeout=5)
            await msg.ack_sync()
            assert msg.data == b'{"n": 1}'
        finally:
            await reader.close()
            await bus.close()


def forged_group(group: str, size: int = 4) -> list[bytes]:
    """A whole schema-valid group of scored samples on version 0, all rewarded."""
    out = []
    for i in range(size):
        request = fake_request(i).model_copy(
            update={"group_id": group, "group_index": i, "request_id": f"{group}-{i}"}
        )
        trajectory = Trajectory(
            request=request,
            version=0,
            prompt_token_ids=request.prompt_token_ids,
            completion_token_ids=(7, 8),
            logprobs=(-0.5, -0.5),
            loss_mask=(1, 1),
            finish_reason="stop",
        )
        scored = ScoredTrajectory(event_id=f"{group}-{i}", trajectory=trajectory, reward=1.0)
        out.append(scored.model_dump_json().encode())
    return out


@pytest.mark.slow
async def test_forged_groups_from_outside_logins_never_reach_a_live_run(tmp_path: Path) -> None:
    steps = 4
    pipeline, run_dir = build_pipeline(tmp_path, None, mode="dora", steps=steps, k=1)
    run = asyncio.create_task(pipeline.run())
    clients: list[Client] = []
    try:
        async with asyncio.timeout(60):
            while pipeline.connected_url is None:
                await asyncio.sleep(0.05)
        url = pipeline.connected_url
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await Client().connect(url)
        for login in ("reader", "producer", "stage-learner", "stage-first_char_is_digit"):
            auth = NatsAuth.from_file(run_dir / "credentials" / f"{login}.json")
            clients.append(await Client().connect(url, auth))
        s = pipeline.subjects
        # before any real sample exists, so the learner would take these first: neither an
        # outside login nor the learner's own may publish scored samples
        reader, producer, learner, verifier = clients
        for n, who in enumerate((reader, producer, learner)):
            for payload in forged_group(f"forged-{n}"):
                assert await who.publish_refused(s.scored, payload)
            assert await who.publish_refused(s.trajectories, b'{"event_id": "forged-t"}')
        # only the learner announces versions and steps
        for who in (reader, producer, verifier):
            assert await who.publish_refused(s.metrics, b'{"step": 500, "values": {}}')
            assert await who.publish_refused(s.weights, b'{"version": 99}')
            assert await who.publish_refused(f"$KV.{s.kv_bucket}.weights.v99")
        for client in clients:
            await client.close()
        clients.clear()
        summary = await asyncio.wait_for(run, timeout=300)
    finally:
        for client in clients:
            await client.close()
        if not run.done():
            run.cancel()
    assert summary["completed"]
    steps_recorded = [json.loads(line) for line in (run_dir / "events/metrics.jsonl").open()]
    assert [m["step"] for m in steps_recorded] == list(range(steps))
    trained = {g for m in steps_recorded for g in m["consumed_groups"]}
    assert len(trained) == steps * 4 and not any(g.startswith("forged") for g in trained)
    for path in (run_dir / "events").glob("*.jsonl"):
        assert b"forged-" not in path.read_bytes(), path.name  # not even a dead letter
