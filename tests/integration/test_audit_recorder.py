"""The run recorder on a real nats-server: every published event lands in its JSONL, once."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

from dora import events
from dora.audit import RunRecorder
from dora.bus import ConsumerSpec, NatsBus
from dora.bus.server import NatsServer


def _prompt(i: int) -> events.Prompt:
    return events.Prompt(prompt_id=f"p{i}", text=f"{i}+{i}=", answer=str(2 * i))


def _trajectory(i: int, version: int) -> events.Trajectory:
    request = events.RolloutRequest(
        request_id=f"r{i}",
        prompt=_prompt(i),
        group_id=f"g{i // 2}",
        group_index=i % 2,
        group_size=2,
        version=version,
    )
    return events.Trajectory(
        request=request,
        version=version,
        prompt_token_ids=(1, 2, 3),
        completion_token_ids=(4, 5),
        logprobs=(-0.1, -0.2),
        loss_mask=(1, 1),
        finish_reason="stop",
        engines=("e0",),
    )


def _ids(path: Path) -> list[str]:
    if not path.is_file():
        return []
    return [json.loads(line)["event_id"] for line in path.read_text().splitlines() if line]


async def test_recorder_keeps_every_event(nats_bus: NatsBus, tmp_path: Path) -> None:
    s = nats_bus.subjects
    # a trajectory published before the recorder starts stays in the (interest) stream while
    # another consumer (the learner's) holds it, and the recorder still gets it
    await nats_bus.consumer(ConsumerSpec("learner", s.trajectories))
    early = _trajectory(99, 0)
    await nats_bus.publish_event(s.trajectories, early)

    recorder = RunRecorder(nats_bus, tmp_path, status_interval_s=0.0, ledger_poll_s=0.05)
    published: dict[str, list[str]] = {"trajectories": [early.event_id]}
    async with recorder:
        trajs = [_trajectory(i, version=i % 2) for i in range(6)]
        scored = [events.ScoredTrajectory(trajectory=t, reward=1.0, correct=True) for t in trajs]
        migration = events.MigrationRecord(
            request_id="r1", source="e0", target="e1", version=1, ok=True, kv_bytes=4096
        )
        metrics = events.Metrics(step=0, values={"reward/mean": 0.5}, consumed_groups=("g0",))
        weights = events.WeightVersion(
            version=1, blob=events.BlobRef(name="w1", size=3), checksum="abc", step=0
        )
        letter = events.DeadLetter(subject=s.scored, payload="{", reason="not JSON")
        for t in trajs:
            await nats_bus.publish_event(s.trajectories, t)
        for sc in scored:
            await nats_bus.publish_event(s.scored, sc)
        await nats_bus.publish_event(s.migrations, migration)
        await nats_bus.publish_event(s.metrics, metrics)
        await nats_bus.publish_event(s.weights, weights)
        await nats_bus.publish_event(s.deadletter, letter)
        await nats_bus.publish(s.metrics, b"not json at all", msg_id="bad-1")
        pretty = b'{\n  "event_id": "pretty",\n  "step": 1,\n  "values": {}\n}'
        await nats_bus.publish(s.metrics, pretty, msg_id="pretty")  # kept, on one line
        ledger = events.Ledger(learner_step=1, staleness_bound=2, batch_groups=4)
        await nats_bus.kv_put("ledger", ledger.model_dump_json().encode())
        published["trajectories"] += [t.event_id for t in trajs]
        published["scored"] = [sc.event_id for sc in scored]
        published["migrations"] = [migration.event_id]
        published["metrics"] = [metrics.event_id, "pretty"]
        published["weights"] = [weights.event_id]
        published["deadletter"] = [letter.event_id]

        # status is live: only what arrives while subscribed is kept, so wait until it is seen
        status = [
            events.EngineStatus(engine_id=f"e{i}", version=0, state="serving") for i in range(3)
        ]
        for st in status:
            await nats_bus.publish_event(s.status(st.engine_id), st)
        for _ in range(200):
            if recorder.stats.written.get("status", 0) >= 3:
                break
            await asyncio.sleep(0.01)
        for _ in range(200):
            if recorder.stats.written.get("ledger", 0) >= 1:
                break
            await asyncio.sleep(0.01)

    events_dir = tmp_path / "events"
    for family, ids in published.items():
        assert sorted(_ids(events_dir / f"{family}.jsonl")) == sorted(ids), family
    assert sorted(_ids(events_dir / "status.jsonl")) == sorted(st.event_id for st in status)
    assert _ids(events_dir / "ledger.jsonl") == [ledger.event_id]
    rejected = [json.loads(x) for x in (events_dir / "rejected.jsonl").read_text().splitlines()]
    assert [r["payload"] for r in rejected] == ["not json at all"]
    assert rejected[0]["reason"].startswith("invalid Metrics: <payload>: Invalid JSON")
    # each line parses back into its wire type
    for line in (events_dir / "scored.jsonl").read_text().splitlines():
        events.ScoredTrajectory.model_validate_json(line)

    # everything written was acked: nothing waits for the recorder on the server
    for family in published:
        spec = ConsumerSpec("recorder", f"{s.root}.{family}", max_ack_pending=1024, ack_wait_s=60)
        state = await (await nats_bus.consumer(spec)).state()
        assert (state.pending, state.ack_pending) == (0, 0), family


async def test_recorder_resumes_after_restart(nats_bus: NatsBus, tmp_path: Path) -> None:
    """A second recorder on the same durable continues where the first stopped: no repeats."""
    s = nats_bus.subjects
    first = events.Metrics(step=0, values={"x": 1.0})
    second = events.Metrics(step=1, values={"x": 2.0})
    async with RunRecorder(nats_bus, tmp_path, status=False, ledger=False):
        await nats_bus.publish_event(s.metrics, first)
    await nats_bus.publish_event(s.metrics, second)
    async with RunRecorder(nats_bus, tmp_path, status=False, ledger=False):
        pass
    assert _ids(tmp_path / "events" / "metrics.jsonl") == [first.event_id, second.event_id]


CRASHING_RECORDER = """
import asyncio, sys
from pathlib import Path
from dora.bus import ConsumerSpec, NatsBus
from dora.audit import ACK_WAIT_S
from dora.subjects import Subjects

async def main(url, run, out):
    bus = NatsBus(Subjects(run), url)
    await bus.connect()
    spec = ConsumerSpec("recorder", bus.subjects.metrics, max_ack_pending=1024,
                        ack_wait_s=ACK_WAIT_S)
    consumer = await bus.consumer(spec)
    msgs = await consumer.fetch(10, timeout=5.0)
    with open(out, "ab") as fh:  # wrote (and flushed) half the batch, acked nothing
        for msg in msgs[: len(msgs) // 2]:
            fh.write(msg.data + b"\\n")
    print(len(msgs), flush=True)
    await asyncio.Event().wait()

asyncio.run(main(*sys.argv[1:]))
"""


async def test_a_sigkilled_recorders_batch_is_recorded_once_by_its_successor(
    nats_bus: NatsBus, nats_server: NatsServer, tmp_path: Path
) -> None:
    """Killed after writing half a fetched batch and acking none of it: the next recorder
    gets the batch back (its drain waits for it) and writes each event exactly once."""
    s = nats_bus.subjects
    sent = [events.Metrics(step=i, values={"x": float(i)}) for i in range(6)]
    for event in sent:
        await nats_bus.publish_event(s.metrics, event)
    out = tmp_path / "events" / "metrics.jsonl"
    out.parent.mkdir(parents=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASHING_RECORDER, nats_server.url, s.run, str(out)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert (await asyncio.to_thread(proc.stdout.readline)).strip() == "6"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert len(_ids(out)) == 3

    recorder = RunRecorder(nats_bus, tmp_path, status=False, ledger=False)
    async with recorder:
        pass  # started and stopped at once: the stop's drain waits for the owed batch
    assert sorted(_ids(out)) == sorted(e.event_id for e in sent)
    assert recorder.stats.redelivered == 3
