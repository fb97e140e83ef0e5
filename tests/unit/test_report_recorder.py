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
