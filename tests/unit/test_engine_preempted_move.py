"""A request the built-in engine preempted (its KV freed) is reported as such and can move to
another engine as tokens only: what the orchestrator's relief does with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from dora.engines.snapshot import decode_snapshot
from dora.engines.torch import EngineConfig, TorchEngine
from dora.models import build_model, save_pretrained
from tests.unit.test_engine_support import make_request, run_all


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, tok = build_model("tiny", seed=0, num_hidden_layers=2)
    return save_pretrained(model, tmp_path_factory.mktemp("ckpt") / "tiny", tok)


def test_a_preempted_request_is_reported_and_moves_as_tokens_only(checkpoint: Path) -> None:
    reqs = [
        make_request(f"r{i}", text=f"What is {i} + 7? Answer:", seed=i, temperature=1.0,
                     max_tokens=120)
        for i in range(4)
    ]  # fmt: skip
    alone = {}
    for r in reqs:
        ref = TorchEngine.from_pretrained(
            checkpoint, EngineConfig(num_blocks=512, ignore_eos=True), "ref"
        )
        ref.add_request(r)
        alone.update(run_all(ref))
    # 4 x ~130 tokens need ~36 blocks of 16: 20 blocks make the engine preempt
    full = TorchEngine.from_pretrained(
        checkpoint, EngineConfig(num_blocks=20, ignore_eos=True), "full"
    )
    roomy = TorchEngine.from_pretrained(
        checkpoint, EngineConfig(num_blocks=512, ignore_eos=True), "roomy"
    )
    for r in reqs:
        full.add_request(r)
    done: dict = {}
    preempted = []
    for _ in range(2_000):
        done.update({t.request.request_id: t for t in full.step()})
        preempted = [r for r in full.status().requests if r.preempted]
        if preempted:
            break
    assert preempted, "the engine never preempted"
    moved = preempted[0]
    assert moved.kv_blocks == 0 and moved.generated > 0
    snapshot = full.export_request(moved.request_id)
    header, payload = decode_snapshot(snapshot)
    assert header.num_cached_tokens == 0 and payload == b""
    roomy.import_request(snapshot)
    full.release_exported(moved.request_id)
    done.update(run_all(full))
    done.update(run_all(roomy))
    assert set(done) == set(alone)
    for rid, t in done.items():
        assert t.completion_token_ids == alone[rid].completion_token_ids, rid
    assert done[moved.request_id].engines == ("full", "roomy")
    # the engine counts a preemption's recompute as re-prefill wherever it resumes
    assert done[moved.request_id].reprefilled_tokens == header.recompute_tokens > moved.generated
