"""A short dora-mode pipeline on two vLLM engines, on real NATS, from a YAML file.

The rollout invariants hold (every step ran, staleness within K, one trajectory per request,
each from one version, nothing dead-lettered) and at least one request migrated between the
vLLM engines with its KV (no re-prefill). An engine holds fewer requests than a step needs
(24 of 32), so a version is spread over both engines and its tail is what consolidation
packs. Needs the ``vllm`` extra; about two minutes on 2 cores.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import yaml

from dora.bus.server import NatsServer
from dora.models import build_model, save_pretrained
from dora.pipeline import load_pipeline
from tests.integration.test_main_job import check_invariants

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

STEPS, K = 8, 2


def pipeline_file(tmp_path: Path, model: Path) -> Path:
    source = {"path": str(model)}
    spec = {
        "name": "vllm_short",
        "stages": [
            {"type": "recorder"},
            {
                "type": "learner",
                "config": {
                    "model": source,
                    "learner": {
                        "batch_groups": 4,
                        "staleness_bound": K,
                        "max_steps": STEPS,
                        "checkpoint_every": 100,
                        "tensorboard": False,
                        "optim": {"lr": 3e-3},
                    },
                    "eval": {"set": {"per_stratum": 0}},
                },
            },
            {"type": "verifier", "config": {"verifier": "exact_match"}},
            {
                "type": "generator",
                "replicas": 2,
                "config": {
                    "model": source,
                    "engine_kind": "vllm",
                    "max_running": 24,
                    "vllm": {
                        "kv_cache_gib": 0.25,
                        "max_model_len": 1024,
                        "block_size": 32,
                        "max_num_seqs": 24,
                    },
                },
            },
            {
                "type": "orchestrator",
                # consolidate whenever the mechanism can: the policy is not what is tested
                "config": {
                    "orchestrator": {
                        "consolidate_below": 0.9,
                        "min_saving_s": 0.0,
                        "consolidate_without_demand": True,
                    }
                },
            },
            {
                "type": "dispatcher",
                "config": {
                    "model": source,
                    "batch_groups": 4,
                    "staleness_bound": K,
                    "group_size": 8,
                    "temperature": 1.0,
                    "max_tokens": 600,
                },
            },
            {"type": "prompt_source", "config": {"task": "arithmetic", "count": 400}},
        ],
    }
    path = tmp_path / "vllm_short.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


async def test_two_vllm_engines_run_dora_mode_with_migration(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    model, tok = build_model("tiny", seed=1, num_hidden_layers=2)
    directory = save_pretrained(model, tmp_path / "model", tok)
    run_dir = tmp_path / "run"
    pipeline = load_pipeline(
        pipeline_file(tmp_path, directory),
        run_id=f"vllm-{uuid.uuid4().hex[:6]}",
        nats_url=nats_server.url,
        run_dir=run_dir,
    )
    summary = await pipeline.run()
    assert summary["completed"]

    trajectories = check_invariants(run_dir, STEPS, K)
    events = run_dir / "events"
    assert all(t["version"] == t["request"]["version"] for t in trajectories)
    assert all(t["reprefilled_tokens"] == 0 for t in trajectories)
    migrated = [t for t in trajectories if t["migrations"]]
    assert migrated, "no request migrated"
    for t in migrated:
        assert len(t["engines"]) == len(t["migrations"]) + 1
        assert {t["engines"][0], t["engines"][-1]} <= {"engine-0", "engine-1"}
    statuses = [json.loads(line) for line in (events / "status.jsonl").open()]
    assert {s["engine_kind"] for s in statuses} == {"vllm"}
    # imports of requests still in flight when the last step ended count there too
    moves = sum(len(t["migrations"]) for t in migrated)
    assert summary["stages"]["generator"]["migrations_in"] >= moves
