"""RunRecorder on the in-memory bus: status thinning, rejected payloads, drain on stop."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from dora import events
from dora.audit import RunRecorder
from dora.bus import MemoryBus
from dora.subjects import Subjects


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


async def test_status_thinned_per_engine_but_changes_kept(tmp_path: Path) -> None:
    bus = MemoryBus(Subjects("unit"))
    await bus.connect()
    # an interval far longer than the test: only the first sample and the changes are kept
    recorder = RunRecorder(bus, tmp_path, status_interval_s=3600.0, ledger=False)
    async with recorder:
        sent = []
        for version, state in [(0, "serving")] * 4 + [(None, "loading"), (1, "serving")]:
            for engine in ("e0", "e1"):
                st = events.EngineStatus(engine_id=engine, version=version, state=state)
                sent.append(st)
                await bus.publish_event(bus.subjects.status(engine), st)
        for _ in range(500):  # live messages are handed over by the broker's queue
            if recorder.stats.written.get("status", 0) + recorder.stats.status_thinned == 12:
                break
            await asyncio.sleep(0.001)
        # durable events published just before stop are drained, not lost
        metrics = [events.Metrics(step=i, values={"x": float(i)}) for i in range(300)]
        for m in metrics:
            await bus.publish_event(bus.subjects.metrics, m)
        await bus.publish(bus.subjects.weights, b"[1, 2]", msg_id="not-an-object")
    await bus.close()

    kept = _lines(tmp_path / "events" / "status.jsonl")
    assert [(r["engine_id"], r["version"], r["state"]) for r in kept] == [
        (e, v, s)
        for v, s in [(0, "serving"), (None, "loading"), (1, "serving")]
        for e in ("e0", "e1")
    ]
    assert recorder.stats.status_thinned == 6
    assert [r["event_id"] for r in _lines(tmp_path / "events" / "metrics.jsonl")] == [
        m.event_id for m in metrics
    ]
    (rejected,) = _lines(tmp_path / "events" / "rejected.jsonl")
    assert rejected["payload"] == "[1, 2]" and rejected["subject"] == bus.subjects.weights
    assert not (tmp_path / "events" / "weights.jsonl").exists()


def _valid_events() -> dict[str, events.Event]:
    prompt = events.Prompt(prompt_id="p", text="1+1=", answer="2")
    request = events.RolloutRequest(
        request_id="r", prompt=prompt, group_id="g", group_index=0, group_size=1, version=1
    )
    trajectory = events.Trajectory(
        request=request,
        version=1,
        prompt_token_ids=(1, 2),
        completion_token_ids=(3,),
        logprobs=(-0.5,),
        loss_mask=(1,),
        finish_reason="stop",
        engines=("e0",),
    )
    return {
        "trajectories": trajectory,
        "scored": events.ScoredTrajectory(trajectory=trajectory, reward=1.0, correct=True),
        "migrations": events.MigrationRecord(
            request_id="r", source="e0", target="e1", version=1, ok=True
        ),
        "metrics": events.Metrics(step=1, values={"reward/mean": 0.5}),
        "weights": events.WeightVersion(
            version=1, blob=events.BlobRef(name="w1", size=3), checksum="abc", step=0
        ),
        "deadletter": events.DeadLetter(subject="x", payload="{", reason="not JSON"),
        "status": events.EngineStatus(engine_id="e0", version=1, state="serving"),
    }


def _subject(bus: MemoryBus, family: str) -> str:
    return bus.subjects.status("e0") if family == "status" else getattr(bus.subjects, family)


def _hostile(valid: events.Event) -> list[tuple[bytes, str]]:
    """Payloads that are not valid events of ``valid``'s type, and what the reason must say."""
    body = json.loads(valid.model_dump_json())
    deep = b'{"event_id":"deep","values":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return [
        (b"{oops", "Invalid JSON"),
        (b'{"event_id": "\xff\xfe"}', "Invalid JSON"),
        (b"[1, 2]", "Input should be an object"),
        (json.dumps({**body, "schema_version": 99}).encode(), "schema_version"),
        (json.dumps({**body, "forged": True}).encode(), "forged: Extra inputs"),
        (json.dumps({**body, "created_at": "yesterday"}).encode(), "created_at"),
        (json.dumps({"event_id": "empty"}).encode(), "Field required"),
        (deep, "invalid"),
    ]


async def test_recorder_keeps_only_valid_events_and_says_why_it_refused_the_rest(
    tmp_path: Path,
) -> None:
    """Forged, malformed and hostile payloads on every recorded subject end in rejected.jsonl
    with a reason; events/ holds only lines that parse back into their wire type, and the run
    reads without problems."""
    from dora.contract import FAMILY_EVENTS
    from dora.report import load_run

    bus = MemoryBus(Subjects("unit"))
    await bus.connect()
    valid = _valid_events()
    expected_reasons: list[str] = []
    recorder = RunRecorder(bus, tmp_path, status_interval_s=0.0, ledger=False)
    async with recorder:
        for family, event in valid.items():
            subject = _subject(bus, family)
            for n, (payload, reason) in enumerate(_hostile(event)):
                await bus.publish(subject, payload, msg_id=f"{family}-bad-{n}")
                expected_reasons.append(reason)
            await bus.publish_event(subject, event)
        for _ in range(2000):  # status is live: handed over by the broker's queue
            if recorder.stats.written.get("status", 0) + recorder.stats.rejected >= 8 * 7 + 1:
                break
            await asyncio.sleep(0.001)
    await bus.close()

    events_dir = tmp_path / "events"
    letters: list[events.DeadLetter] = []
    for family, event in valid.items():
        lines = (events_dir / f"{family}.jsonl").read_text().splitlines()
        parsed = [FAMILY_EVENTS[family].model_validate_json(x) for x in lines]
        if family == "deadletter":  # with the recorder's own letters: see below
            letters = [e for e in parsed if e != event]  # type: ignore[misc]
            parsed = [e for e in parsed if e == event]
        assert parsed == [event], family
    rejected = _lines(events_dir / "rejected.jsonl")
    # migrations and deadletter have no other reader: the recorder dead-letters what it refused
    own = [r for r in rejected if str(r["subject"]).endswith((".migrations", ".deadletter"))]
    assert len(own) == 16
    assert sorted((d.subject, d.reason, d.stage) for d in letters) == sorted(
        (str(r["subject"]), str(r["reason"]), "recorder") for r in own
    )
    assert len(rejected) == len(expected_reasons) == recorder.stats.rejected
    by_subject: dict[str, list[str]] = {}
    for record in rejected:
        by_subject.setdefault(str(record["subject"]), []).append(str(record["reason"]))
    for family, event in valid.items():
        subject = _subject(bus, family)
        reasons = by_subject[subject]
        model = type(event).__name__
        assert all(r.startswith(f"invalid {model}") for r in reasons), reasons
        for reason, expected in zip(reasons, (e for _, e in _hostile(event)), strict=True):
            assert expected in reason, (family, reason)
    assert all(len(str(r["payload"])) <= 4096 for r in rejected)
    assert load_run(tmp_path).problems == []
