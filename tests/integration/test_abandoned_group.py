"""A request an engine refuses after dispatch abandons its group; the run goes on.

A prompt that fits the model's context (so the dispatcher admits it) but needs more KV cache
than an engine has is refused by every engine at admission: its group can never finish.
Before abandonment existed, the learner waited for that group at its staleness deadline
forever. Now the generator's dead letter tells the dispatcher, which settles the group; the
learner stops waiting and never trains on the group's other samples.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from dora.bus import NatsBus
from dora.bus.server import NatsServer
from dora.events import DeadLetter, Ledger, Prompt
from dora.learner.metrics import read_metrics
from dora.subjects import Subjects

from .test_main_job import B, G, build_pipeline

pytestmark = [pytest.mark.nats, pytest.mark.slow]

K, STEPS = 1, 6
KV_TOKENS = 64 * 16  # num_blocks x block_size: far below the model's 4096-token context


async def test_a_request_no_engine_can_hold_abandons_its_group_and_the_run_completes(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    engine = {"num_blocks": 64, "max_num_seqs": 32}
    pipeline, run_dir = build_pipeline(
        tmp_path, nats_server.url, mode="dora", steps=STEPS, k=K, engine=engine
    )
    outsider = NatsBus(Subjects(pipeline.run_id), nats_server.url)
    await outsider.connect()
    s = outsider.subjects
    text = "1+" * KV_TOKENS + "1="  # ~2,000 tokens: in the context, over the KV cache
    too_big = Prompt(prompt_id="too-big-for-kv", text=text, answer=str(KV_TOKENS + 1))
    try:
        await outsider.publish_event(s.prompts, too_big)  # first in the queue: tagged v0
        summary = await asyncio.wait_for(pipeline.run(), timeout=300)  # stalled forever before
        raw = await outsider.kv_get("ledger")
    finally:
        await outsider.close()
    assert summary["completed"]
    assert raw is not None
    assert "too-big-for-kv" in Ledger.model_validate_json(raw).abandoned_groups

    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert all(m["values"]["staleness/max"] <= K for m in metrics)
    steps = [json.loads(line) for line in (run_dir / "events" / "metrics.jsonl").open()]
    trained = {g for m in steps for g in m["consumed_groups"]}
    assert "too-big-for-kv" not in trained and len(trained) >= STEPS * B

    letters = [
        DeadLetter.model_validate_json(line)
        for line in (run_dir / "events" / "deadletter.jsonl").open()
    ]
    refused = [d for d in letters if "too-big-for-kv" in d.payload]
    assert refused and all(d.stage.startswith("generator:") for d in refused)
    assert all("KV blocks" in d.reason for d in refused)
    assert {json.loads(d.payload)["group_index"] for d in refused} == set(range(G))
    assert "too-big-for-kv" not in (run_dir / "events" / "scored.jsonl").read_text()
