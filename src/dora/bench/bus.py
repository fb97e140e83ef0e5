"""``dora bench bus``: NatsBus against raw nats-py JetStream, same server, same run.

Both sides move the same Trajectory events (about ``--payload-bytes`` of JSON each) through a
durable stream: one connection publishes (waiting for each PubAck, deduplicated by event id),
another fetches with a durable pull consumer in batches and acks. Throughput is events over the
time from the first publish to the last receipt; latency is publish-start to receipt. The
table reports the NatsBus/raw throughput ratio (goal: >= 0.7).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import typer


@dataclass
class Measured:
    impl: str
    events: int
    seconds: float
    latencies_s: list[float]

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds

    def percentile_ms(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return 1000.0 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_events(count: int, payload_bytes: int) -> list:
    """``count`` distinct Trajectory events padded to about ``payload_bytes`` of JSON."""
    from dora.events import Prompt, RolloutRequest, Trajectory

    def one(i: int, pad: int) -> Trajectory:
        prompt = Prompt(prompt_id=f"p{i}", text="Compute 12 * 7.", answer="84")
        request = RolloutRequest(
            request_id=f"r{i}", prompt=prompt, group_id=f"g{i}", group_index=0, version=1
        )
        completion = tuple(range(100, 164))
        return Trajectory(
            request=request,
            version=1,
            prompt_token_ids=tuple(range(16)),
            completion_token_ids=completion,
            logprobs=tuple(-0.25 for _ in completion),
            loss_mask=tuple(1 for _ in completion),
            text="x" * pad,
            finish_reason="stop",
            engines=("e0",),
        )

    pad = max(0, payload_bytes - len(one(0, 0).model_dump_json()))
    return [one(i, pad) for i in range(count)]


async def _pump(publish, fetch_ack, events: list, impl: str) -> Measured:
    """Run producer and consumer concurrently; ``fetch_ack`` returns the msg ids it acked."""
    sent: dict[str, float] = {}
    latencies: list[float] = []

    async def produce() -> None:
        for event in events:
            sent[event.event_id] = time.perf_counter()
            await publish(event)

    start = time.perf_counter()
    producer = asyncio.create_task(produce())
    while len(latencies) < len(events):
        for msg_id in await fetch_ack():
            latencies.append(time.perf_counter() - sent[msg_id])
    elapsed = time.perf_counter() - start
    await producer
    return Measured(impl, len(events), elapsed, latencies)


async def run_bus(url: str, events: list, batch: int, max_ack_pending: int) -> Measured:
    from dora.bus import ConsumerSpec, NatsBus
    from dora.subjects import Subjects

    subjects = Subjects("bench" + uuid.uuid4().hex[:8])
    producer, consumer_bus = NatsBus(subjects, url), NatsBus(subjects, url)
    await producer.connect()
    await consumer_bus.connect()
    subject = subjects.trajectories
    consumer = await consumer_bus.consumer(
        ConsumerSpec("bench", subject, max_ack_pending=max_ack_pending)
    )

    async def publish(event) -> None:
        await producer.publish_event(subject, event)

    async def fetch_ack() -> list[str]:
        ids = []
        for msg in await consumer.fetch(batch=batch, timeout=1.0):
            ids.append(msg.msg_id)
            await msg.ack()
        return ids

    try:
        return await _pump(publish, fetch_ack, events, "NatsBus")
    finally:
        await producer.close()
        await consumer_bus.close()


async def run_raw(url: str, events: list, batch: int, max_ack_pending: int) -> Measured:
    """The same traffic through nats-py only (streams created like NatsBus creates them)."""
    import nats
    from nats.js import api

    from dora.bus import NatsBus
    from dora.subjects import Subjects

    subjects = Subjects("bench" + uuid.uuid4().hex[:8])
    setup = NatsBus(subjects, url)
    await setup.connect()  # identical stream configuration; not timed
    await setup.close()
    nc_pub, nc_sub = await nats.connect(url), await nats.connect(url)
    js_pub, js_sub = nc_pub.jetstream(), nc_sub.jetstream()
    subject = subjects.trajectories
    sub = await js_sub.pull_subscribe(
        subject,
        durable="bench",
        stream=subjects.stream("trajectories"),
        config=api.ConsumerConfig(
            ack_policy=api.AckPolicy.EXPLICIT, max_ack_pending=max_ack_pending
        ),
    )

    async def publish(event) -> None:
        data = event.model_dump_json().encode()
        await js_pub.publish(subject, data, headers={"Nats-Msg-Id": event.event_id})

    async def fetch_ack() -> list[str]:
        try:
            msgs = await sub.fetch(batch, timeout=1.0)
        except TimeoutError:  # nats-py raises its own subclass or the builtin one
            return []
        ids = []
        for msg in msgs:
            ids.append(msg.headers["Nats-Msg-Id"])
            await msg.ack()
        return ids

    try:
        return await _pump(publish, fetch_ack, events, "raw nats-py")
    finally:
        await nc_pub.close()
        await nc_sub.close()


async def bench(
    url: str, count: int, payload_bytes: int, batch: int, rounds: int, max_ack_pending: int
) -> list[Measured]:
    results = []
    for _ in range(rounds):  # interleaved, so drift of a shared machine hits both alike
        for runner in (run_raw, run_bus):
            events = make_events(count, payload_bytes)
            results.append(await runner(url, events, batch, max_ack_pending))
    return results


def summarize(results: list[Measured], payload_bytes: int) -> list[dict[str, object]]:
    """One row per implementation: median of the rounds, and the ratio to raw nats-py."""
    rows: list[dict[str, object]] = []
    for impl in ("raw nats-py", "NatsBus"):
        mine = [r for r in results if r.impl == impl]
        rows.append(
            {
                "impl": impl,
                "events": mine[0].events,
                "payload_bytes": payload_bytes,
                "rounds": len(mine),
                "events_per_s": statistics.median(r.events_per_s for r in mine),
                "p50_ms": statistics.median(r.percentile_ms(0.50) for r in mine),
                "p99_ms": statistics.median(r.percentile_ms(0.99) for r in mine),
            }
        )
    raw = float(rows[0]["events_per_s"])  # type: ignore[arg-type]
    for row in rows:
        row["ratio_vs_raw"] = float(row["events_per_s"]) / raw  # type: ignore[arg-type]
    return rows


def cli(
    events: int = typer.Option(3000, "--events", help="Events per implementation and round."),
    payload_bytes: int = typer.Option(2048, "--payload-bytes", help="JSON size of one event."),
    batch: int = typer.Option(64, "--batch", help="Consumer fetch batch size."),
    rounds: int = typer.Option(2, "--rounds", help="Interleaved rounds (median reported)."),
    max_ack_pending: int = typer.Option(1024, "--max-ack-pending"),
    nats_url: str = typer.Option("", "--nats", help="Use this server instead of an embedded one."),
    results_dir: Path = typer.Option(Path("runs/bench"), "--results-dir"),
) -> None:
    """Events/s and latency of NatsBus vs raw nats-py JetStream (publish, fetch, ack)."""
    from dora.bench.report import print_table, save_rows
    from dora.bus.server import NatsServer

    def go(url: str) -> list[Measured]:
        return asyncio.run(bench(url, events, payload_bytes, batch, rounds, max_ack_pending))

    if nats_url:
        results = go(nats_url)
    else:
        with (
            tempfile.TemporaryDirectory(prefix="dora-bench-bus-") as tmp,
            NatsServer(Path(tmp)) as server,
        ):
            results = go(server.url)
    rows = summarize(results, payload_bytes)
    print_table("dora bench bus: durable publish -> pull fetch -> ack", rows)
    meta = {"events": events, "batch": batch, "rounds": rounds, "max_ack_pending": max_ack_pending}
    path = save_rows("bus", rows, meta=meta, results_dir=results_dir)
    typer.echo(f"saved {path}")
