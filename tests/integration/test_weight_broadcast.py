"""``weight_store: broadcast``: weights from the learner's memory to the engines loading them,
over a gloo process group per wave. Two engine processes that ask at once are served by one
broadcast and receive the object-store path's bytes exactly (sha256); a retired version and
a vanished server are clear errors; a training run with it keeps the rollout invariants."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dora.bus import NatsBus
from dora.events import BlobRef
from dora.learner.broadcast import BroadcastConfig, BroadcastServer, BroadcastTransport, receive
from dora.learner.weights import (
    WeightError,
    WeightFetcher,
    WeightPublisher,
    deserialize_state_dict,
)
from dora.models import LlamaModel, build_model, hf_state_dict
from tests.integration.test_run_resume import check_invariants, start
from tests.integration.test_stage_processes import finish, split_pipeline

pytestmark = pytest.mark.nats

RECEIVER = """
import hashlib, sys
from dora.events import BlobRef
from dora.learner.broadcast import receive
ref = BlobRef.model_validate_json(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()  # go: both ask within milliseconds
data = receive(ref, timeout_s=60)
open(sys.argv[2], "wb").write(data)
print(hashlib.sha256(data).hexdigest(), flush=True)
"""


def tiny_model() -> LlamaModel:
    model, _ = build_model(
        "tiny", num_hidden_layers=2, hidden_size=64, intermediate_size=128, head_dim=16
    )
    return model


async def test_two_engine_processes_get_the_object_store_bytes_in_one_wave(
    nats_bus: NatsBus, tmp_path: Path
) -> None:
    model = tiny_model()
    stored = await WeightPublisher(nats_bus).publish(model, 1, step=0)
    server = BroadcastServer(BroadcastConfig(gather_s=0.5, bucket_mb=0.05, timeout_s=30))
    try:
        sent = await WeightPublisher(nats_bus, BroadcastTransport(server)).publish(model, 2, step=1)
        assert sent.blob.store == "broadcast" and sent.blob.name.startswith(server.address)
        assert sent.checksum == stored.checksum  # the same bytes, another road
        engines = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    RECEIVER,
                    sent.blob.model_dump_json(),
                    str(tmp_path / f"{i}"),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        for engine in engines:
            assert engine.stdout is not None and engine.stdout.readline().strip() == "ready"
        for engine in engines:
            assert engine.stdin is not None
            engine.stdin.write("go\n")
            engine.stdin.flush()
        digests = [engine.communicate(timeout=120)[0].strip() for engine in engines]
        assert [e.returncode for e in engines] == [0, 0]
        assert digests == [stored.checksum, stored.checksum]
        assert [(w.name, w.receivers) for w in server.waves] == [
            (sent.blob.name.partition("/")[2], 2)
        ]  # one broadcast for both, in buckets of 50 KiB
        want = hf_state_dict(model)
        for i in range(2):
            got = deserialize_state_dict((tmp_path / f"{i}").read_bytes())
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        # an engine in this process, through the fetcher as a generator loads a version
        state = await WeightFetcher(nats_bus).fetch(2)
        assert all(torch.equal(state[k], want[k]) for k in want)
        assert [w.receivers for w in server.waves] == [2, 1]
        # a pruned version is refused at once, not waited for
        await BroadcastTransport(server).delete(sent.blob)
        with pytest.raises(WeightError, match="not held"):
            receive(sent.blob, timeout_s=5)
    finally:
        server.close()


def test_a_server_that_is_gone_is_a_weight_error() -> None:
    server = BroadcastServer(BroadcastConfig(timeout_s=5))
    ref = server.offer("weights-v000001-ab", b"\0" * 10)
    server.close()
    del server  # its TCPStore (and port) go with it
    dead = BlobRef.model_validate({**ref.model_dump(), "name": "127.0.0.1:1/weights-v000001-ab"})
    with pytest.raises(WeightError, match="no broadcast server"):
        receive(dead, timeout_s=3)


@pytest.mark.slow
def test_a_run_with_broadcast_weights_keeps_the_rollout_invariants(tmp_path: Path) -> None:
    steps = 6
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    pipeline = split_pipeline(tmp_path, steps)
    text = pipeline.read_text().replace(
        "optim: {lr: 1.0e-3}", "optim: {lr: 1.0e-3}, weight_store: broadcast"
    )
    assert "weight_store: broadcast" in text
    pipeline.write_text(text)
    finish(start(["run", str(pipeline), "--run-dir", str(run_dir)], log), log)
    check_invariants(run_dir, steps=steps)
    weights = [json.loads(line) for line in (run_dir / "events" / "weights.jsonl").open()]
    assert len(weights) == steps + 1  # v0 and one per step
    assert {w["blob"]["store"] for w in weights} == {"broadcast"}
    loads = [json.loads(line) for line in (run_dir / "events" / "status.jsonl").open()]
    served = {s["version"] for s in loads if s.get("state") == "serving"}
    assert max(served) >= steps - 2  # the engines loaded recent versions through it
