"""Hostile input on every subject of a live training run (real nats-server, real learner).

While the main job's parts run (prompt source, dispatcher, two built-in engines, orchestrator,
reward, GRPO learner, recorder), an outside client publishes malformed and forged messages on
every subject the run uses: invalid JSON and UTF-8, wrong types, missing fields, a future
schema version, deeply nested and oversized payloads, a prompt longer than the model's
context, out-of-range token ids, duplicated ids and references to versions never published.
Each carries a marker. The run must finish every step with its invariants; every hostile
message must leave a dead letter with a reason; no marker may reach the recorded streams or
the learner's batches.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

from dora.bus import NatsBus
from dora.bus.server import NatsServer
from dora.events import DeadLetter, ScoredTrajectory
from dora.learner.metrics import read_metrics
from dora.report import load_run, summarize
from dora.stage.deadletter import original_payload
from dora.subjects import Subjects

from .test_main_job import build_pipeline

pytestmark = [pytest.mark.nats, pytest.mark.slow]

K, STEPS = 1, 8
MARK = re.compile(rb"HOSTILE-(\d{4})")
OVERSIZED = 600_000  # over the dead letter's inline limit (256 kB), under NATS's 1 MB


class Hostile:
    """Builds numbered hostile payloads and remembers which subject each went to."""

    def __init__(self) -> None:
        self.sent: dict[int, str] = {}
        self.recordable: set[int] = set()
        """Schema-valid with known versions, wrong only for this model (token ids past its
        vocabulary): the recorder cannot tell, the learner can."""

    def mark(self, subject: str) -> str:
        n = len(self.sent)
        self.sent[n] = subject
        return f"HOSTILE-{n:04d}"

    def malformed(self, subject: str, template: dict[str, Any]) -> list[bytes]:
        """The same eight defects for any subject; ``template`` is a valid event of it."""
        out = []
        m = self.mark(subject)
        out.append(f"{{not json {m}".encode())
        m = self.mark(subject)
        out.append(b"\xff\xfe" + m.encode() + bytes(range(128, 256)))
        m = self.mark(subject)
        out.append(json.dumps([m, template]).encode())
        m = self.mark(subject)
        out.append(json.dumps({**template, "event_id": m, "schema_version": 99}).encode())
        m = self.mark(subject)
        out.append(json.dumps({**template, "event_id": m, "created_at": "yesterday"}).encode())
        m = self.mark(subject)
        out.append(json.dumps({"event_id": m}).encode())
        m = self.mark(subject)
        out.append(f'{{"event_id": "{m}", "x": '.encode() + b"[" * 100_000 + b"]" * 100_000 + b"}")
        m = self.mark(subject)
        out.append(json.dumps({**template, "event_id": m, "junk": "x" * OVERSIZED}).encode())
        return out


def forged_scored(h: Hostile, subject: str, real: ScoredTrajectory) -> list[bytes]:
    """Schema-valid samples the learner must not train on."""
    traj = real.trajectory
    n = len(traj.completion_token_ids)

    def variant(**changes: Any) -> bytes:
        m = h.mark(subject)
        trajectory = traj.model_copy(update=changes.pop("trajectory", {}))
        event = real.model_copy(update={"event_id": m, "trajectory": trajectory, **changes})
        return event.model_dump_json().encode()

    future = traj.request.model_copy(update={"version": 999, "admitted_version": 999})
    out = [
        variant(),  # a second sample for a request already received: duplicated id
        variant(trajectory={"request": future, "version": 999}),  # a version never published
        variant(trajectory={"completion_token_ids": (10**6,) * n}),  # out-of-range token ids
    ]
    h.recordable.add(len(h.sent) - 1)
    return out


async def test_hostile_messages_on_every_subject_are_dead_lettered_and_the_run_completes(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    pipeline, run_dir = build_pipeline(tmp_path, nats_server.url, mode="dora", steps=STEPS, k=K)
    outsider = NatsBus(Subjects(pipeline.run_id), nats_server.url)
    await outsider.connect()
    s = outsider.subjects
    scored_seen = await outsider.subscribe(s.scored)
    h = Hostile()
    # bad prompts first: the prompt queue is consumed in order and the run needs only a
    # tenth of the prompt source's 400, so later ones would still be waiting at the end
    prompt = {"prompt_id": "p", "text": "1+1=", "answer": "2"}
    for payload in h.malformed(s.prompts, prompt):
        await outsider.publish(s.prompts, payload)
    too_long = {**prompt, "prompt_id": h.mark(s.prompts), "text": "1+" * 5000 + "1="}
    await outsider.publish(s.prompts, json.dumps(too_long).encode())  # past the context
    run = asyncio.create_task(pipeline.run())
    try:
        async with asyncio.timeout(120):
            first = ScoredTrajectory.model_validate_json((await anext(aiter(scored_seen))).data)
        await scored_seen.unsubscribe()
        real_traj = first.trajectory
        request = real_traj.request
        templates: dict[str, dict[str, Any]] = {
            s.requests(0): json.loads(request.model_dump_json()),
            s.trajectories: json.loads(real_traj.model_dump_json()),
            s.scored: json.loads(first.model_dump_json()),
            s.weights: {"version": 1, "blob": {"store": "inline", "name": "w"}, "checksum": ""},
            s.metrics: {"step": 0, "values": {}},
            s.migrations: {"request_id": "r", "source": "a", "target": "b", "version": 0},
            s.deadletter: {"subject": "x", "payload": "", "reason": "r"},
            s.status("e0"): {"engine_id": "e0", "state": "serving"},
        }
        batches: list[tuple[str, bytes]] = []
        for subject, template in templates.items():
            batches += [(subject, p) for p in h.malformed(subject, template)]
        batches += [(s.scored, p) for p in forged_scored(h, s.scored, first)]

        def forged(subject: str, event: Any, **changes: Any) -> None:
            m = h.mark(subject)
            payload = event.model_copy(update={"event_id": m, **changes})
            batches.append((subject, payload.model_dump_json().encode()))

        out_of_vocab = request.model_copy(update={"prompt_token_ids": (10**6,)})
        forged(s.requests(0), out_of_vocab, request_id="forged-vocab")
        forged(s.requests(0), request, version=5, request_id="forged-tag")  # on v0's queue
        forged(s.trajectories, real_traj, version=999)  # its scored sample names v999
        for subject, payload in batches:
            await outsider.publish(subject, payload)
        # references to things never published: the dispatcher must not believe them
        blob = {"store": "inline", "name": "w", "size": 1}
        weights = {"version": 999, "blob": blob, "checksum": "", "step": 998}
        await outsider.publish(s.weights, json.dumps(weights).encode())
        h.sent[len(h.sent)] = s.weights  # marker-free: found by its version below
        metrics = {"step": 500, "values": {}, "consumed_groups": ["HOSTILE-group"]}
        await outsider.publish(s.metrics, json.dumps(metrics).encode())
        h.sent[len(h.sent)] = s.metrics
        summary = await asyncio.wait_for(run, timeout=180)  # ~10 s; a deceived run stalls
    finally:
        if not run.done():
            run.cancel()
        await outsider.close()

    assert summary["completed"]
    # the run's result: every step, within K, one trajectory per request, nothing forged trained
    metrics_rows = read_metrics(run_dir)
    assert [m["step"] for m in metrics_rows] == list(range(STEPS))
    assert all(m["values"]["staleness/max"] <= K for m in metrics_rows)
    events = run_dir / "events"
    trajectories = [json.loads(line) for line in (events / "trajectories.jsonl").open()]
    ids = [t["request"]["request_id"] for t in trajectories]
    assert len(ids) == len(set(ids)) and not any(i.startswith("forged") for i in ids)
    for path in events.glob("*.jsonl"):
        if path.name not in ("deadletter.jsonl", "rejected.jsonl"):
            data = path.read_bytes()
            marks = {int(x) for x in MARK.findall(data)}
            assert marks <= h.recordable and b"HOSTILE-group" not in data, path.name
    steps = [json.loads(line) for line in (events / "metrics.jsonl").open()]
    trained = {g for m in steps for g in m["consumed_groups"]}
    assert len(steps) == STEPS and len(trained) == STEPS * 4  # B = 4 groups a step
    assert not any("HOSTILE" in g or g.startswith("forged") for g in trained)
    recorded = load_run(run_dir)
    assert recorded.problems == []
    digest = summarize(recorded)
    assert digest.learner_steps == STEPS and digest.trajectories == len(ids)

    # every hostile message left a dead letter that says why, and every dead letter is ours
    forged_weights, forged_metrics = len(h.sent) - 2, len(h.sent) - 1
    letters = [
        DeadLetter.model_validate_json(line) for line in (events / "deadletter.jsonl").open()
    ]
    found: dict[int, list[DeadLetter]] = {}
    for letter in letters:
        assert letter.reason, letter
        raw = original_payload(letter)
        owners = {int(x) for x in MARK.findall(raw)}
        if letter.subject == s.weights and "no policy version 999" in letter.reason:
            owners.add(forged_weights)
        if letter.subject == s.metrics and "no policy version 501" in letter.reason:
            owners.add(forged_metrics)
        assert owners, f"a dead letter no hostile message explains: {letter.reason}"
        for n in owners:
            found.setdefault(n, []).append(letter)
    missing = {n: h.sent[n] for n in h.sent if n not in found}
    assert not missing, f"hostile messages without a dead letter: {missing}"
    assert any(d.reason.startswith("refused: prompt 'HOSTILE-") for d in letters)
