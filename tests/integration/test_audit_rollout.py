"""The recorder beside real generators (engine double) and the migrator on nats-server: live
status, the migration record and the migrated trajectory all reach the report."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from dora.audit import RunRecorder
from dora.bus import ConsumerSpec, NatsBus
from dora.events import AssignVersion, Drain, Migrate, Prompt, RolloutRequest, SamplingParams
from dora.report import load_run, render_report, summarize
from dora.rollout.generator import Generator
from dora.rollout.generator_config import GeneratorConfig
from dora.rollout.migrator import Migrator
from tests.fakes import FakeEngine

pytestmark = pytest.mark.nats


async def _no_weights(version: int) -> dict[str, Any]:
    return {}


def _generator(bus: NatsBus, engine_id: str) -> Generator:
    config = GeneratorConfig(engine_id=engine_id, initial_version=0, status_interval_s=0.1)
    return Generator(FakeEngine(engine_id), bus, _no_weights, config)


def _request(i: int, max_tokens: int) -> RolloutRequest:
    return RolloutRequest(
        request_id=f"r{i}",
        prompt=Prompt(prompt_id=f"p{i}", text="1+1=", answer="2"),
        prompt_token_ids=(5, 6, 7),
        group_id=f"g{i}",
        group_index=0,
        sampling=SamplingParams(seed=i, max_tokens=max_tokens),
        version=0,
    )


async def _until(predicate: Any, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_recorder_beside_generators_and_migration(nats_bus: NatsBus, tmp_path: Path) -> None:
    s = nats_bus.subjects
    await nats_bus.consumer(ConsumerSpec("learner", s.trajectories))  # the stream's reader
    source, target = _generator(nats_bus, "src"), _generator(nats_bus, "dst")
    source.engine.freeze_at = 5
    async with RunRecorder(nats_bus, tmp_path, status_interval_s=0.0) as recorder:
        await nats_bus.publish_event(s.requests(0), _request(1, max_tokens=20))
        tasks = [asyncio.create_task(source.run())]
        try:
            # the source holds the request before the target exists: nobody else can pull it
            await _until(lambda: any(len(q.tokens) == 5 for q in source.engine.running.values()))
            tasks.append(asyncio.create_task(target.run()))
            await target.ready.wait()
            # the target must not pull the request itself, then takes it over with its KV
            await nats_bus.request(
                s.control("dst"), Drain(engine_id="dst").model_dump_json().encode()
            )
            await nats_bus.request(
                s.control("dst"),
                AssignVersion(engine_id="dst", version=0).model_dump_json().encode(),
            )
            outcomes = await Migrator(nats_bus).execute(
                Migrate(source="src", target="dst", version=0, request_ids=("r1",))
            )
            assert [o.ok for o in outcomes] == [True]
            await _until(lambda: recorder.stats.written.get("trajectories", 0) == 1)
            await _until(lambda: {"src", "dst"} <= {e for e in _engines_seen(tmp_path)})
        finally:
            for g in (source, target):
                g.stop()
            await asyncio.gather(*tasks, return_exceptions=True)

    run = load_run(tmp_path)
    assert run.problems == []
    summary = summarize(run)
    assert (summary.trajectories, summary.migrations_ok, summary.reprefilled_tokens) == (1, 1, 0)
    (traj,) = run.trajectories
    assert traj.engines == ("src", "dst") and traj.migrations == 1
    (mig,) = run.migrations
    assert (mig.request_id, mig.source, mig.target, mig.ok) == ("r1", "src", "dst", True)
    assert {st.engine_id for st in run.status} == {"src", "dst"}
    served = {(st.engine_id, st.version) for st in run.status if st.state == "serving"}
    assert {("src", 0), ("dst", 0)} <= served
    assert render_report(run).stat().st_size > 10_000


def _engines_seen(run_dir: Path) -> set[str]:
    import json

    path = run_dir / "events" / "status.jsonl"
    if not path.is_file():
        return set()
    return {json.loads(x)["engine_id"] for x in path.read_text().splitlines() if x.endswith("}")}
