"""examples/external_consumer.py: a plain nats-py program validates a run's trajectories."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from dora.bus import ConsumerSpec, NatsBus
from dora.bus.server import NatsServer
from tests.unit.test_schemas import trajectory

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "external_consumer.py"


def _run(url: str, run_id: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--nats", url, "--run", run_id, *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_imports_nothing_from_dora() -> None:
    tree = ast.parse(SCRIPT.read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m == "dora" or m.startswith("dora.") for m in modules)


async def test_validates_real_trajectories_and_flags_a_bad_one(
    nats_bus: NatsBus, nats_server: NatsServer, run_id: str
) -> None:
    subject = nats_bus.subjects.trajectories
    learner = await nats_bus.consumer(ConsumerSpec("learner", subject))  # keeps them stored
    sent = [trajectory(i) for i in range(3)]
    for event in sent:
        await nats_bus.publish_event(subject, event)
    bad = json.loads(sent[0].model_dump_json()) | {"event_id": "bad1", "surprise": True}
    await nats_bus.publish(subject, json.dumps(bad).encode(), msg_id="bad1")

    result = _run(nats_server.url, run_id, "--max", "4")
    lines = result.stdout.splitlines()
    assert lines[:3] == [f"valid {e.event_id}" for e in sent], result.stderr
    assert lines[3].startswith("INVALID bad1") and "surprise" in lines[3]
    assert lines[-1] == "validated 3, invalid 1"
    assert result.returncode == 1

    # its own durable consumer: the learner still gets every trajectory
    got = await learner.fetch(batch=10, timeout=2.0)
    assert [m.msg_id for m in got] == [*(e.event_id for e in sent), "bad1"]


async def test_all_valid_exits_zero_and_resumes_its_durable(
    nats_bus: NatsBus, nats_server: NatsServer, run_id: str
) -> None:
    subject = nats_bus.subjects.trajectories
    await nats_bus.consumer(ConsumerSpec("learner", subject))
    sent = [trajectory(i) for i in range(4)]
    for event in sent:
        await nats_bus.publish_event(subject, event)
    first = _run(nats_server.url, run_id, "--max", "2")
    second = _run(nats_server.url, run_id, "--idle-timeout", "1")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first.stdout.splitlines()[:2] == [f"valid {e.event_id}" for e in sent[:2]]
    assert second.stdout.splitlines() == [
        *(f"valid {e.event_id}" for e in sent[2:]),
        "validated 2, invalid 0",
    ]
