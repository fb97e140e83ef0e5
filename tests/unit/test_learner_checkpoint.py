"""Learner checkpoints (atomic, resumable) and the metrics writer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dora.learner.batching import GroupBuffer
from dora.learner.checkpoint import CheckpointManager, LearnerState
from dora.learner.metrics import MetricsWriter, read_metrics
from dora.learner.synthetic import make_scored
from dora.learner.trainer import Trainer
from dora.models import LlamaModel, build_model, hf_state_dict, load_pretrained


def tiny(seed: int = 0) -> LlamaModel:
    model, _ = build_model(
        "tiny", seed=seed, num_hidden_layers=2, hidden_size=64, intermediate_size=128, head_dim=16
    )
    return model


def trained_trainer() -> Trainer:
    trainer = Trainer(tiny())
    buf = GroupBuffer(staleness_bound=5)
    for i in range(2):
        buf.add(make_scored(group_id="g", group_index=i, group_size=2, reward=i), step=0)
    trainer.step(list(buf.ready.values()))
    return trainer


def test_save_and_load_restore_everything(tmp_path: Path) -> None:
    trainer = trained_trainer()
    buffered = [make_scored(group_id="p", group_index=0, group_size=2, version=1)]
    state = LearnerState(
        step=7,
        consumed_groups=["g"],
        refused_groups=["r"],
        consumed_by_version={0: 1},
        refused_by_version={1: 1},
        buffered=buffered,
        counters={"duplicates": 2.0},
    )
    manager = CheckpointManager(tmp_path / "ckpt")
    path = manager.save(trainer.model, trainer.state_dict(), state)
    assert path.name == "step_000007" and manager.latest() == path
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))
    # the model directory is a plain HF checkpoint
    reloaded = load_pretrained(path / "model")
    want = hf_state_dict(trainer.model)
    assert all(torch.equal(v, hf_state_dict(reloaded)[k]) for k, v in want.items())

    fresh = Trainer(tiny(seed=5))
    trainer_state, loaded = manager.load(fresh.model)
    fresh.load_state_dict(trainer_state)
    assert all(torch.equal(v, hf_state_dict(fresh.model)[k]) for k, v in want.items())
    assert loaded.step == 7 and loaded.consumed_groups == ["g"] and loaded.refused_groups == ["r"]
    assert loaded.consumed_by_version == {0: 1} and loaded.refused_by_version == {1: 1}
    assert loaded.buffered == buffered
    assert fresh.scheduler.last_epoch == trainer.scheduler.last_epoch == 1
    assert (
        fresh.optimizer.state_dict()["state"].keys()
        == trainer.optimizer.state_dict()["state"].keys()
    )


def test_rng_is_restored(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    model = tiny()
    torch.manual_seed(123)
    manager.save(model, {}, LearnerState(step=1))
    expected = torch.rand(3)
    torch.manual_seed(999)
    manager.load(model)
    assert torch.equal(torch.rand(3), expected)


def test_keeps_the_newest_checkpoints(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2)
    model = tiny()
    for step in (1, 2, 3):
        manager.save(model, {}, LearnerState(step=step))
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000002", "step_000003"]
    assert manager.latest() == tmp_path / "step_000003"


def test_no_checkpoint_means_none(tmp_path: Path) -> None:
    assert CheckpointManager(tmp_path).latest() is None


def test_metrics_jsonl_and_tensorboard(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path, tensorboard=True)
    for step in range(4):
        writer.write(step, {"loss/pg": float(step), "reward/mean": 0.5})
    writer.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[2]["values"]["loss/pg"] == 2.0
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    # resuming at step 2 drops the lines of steps 2.. written by the crashed run
    resumed = MetricsWriter(tmp_path, tensorboard=False, resume_step=2)
    resumed.write(2, {"loss/pg": 20.0, "bad": float("nan")})
    resumed.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[-1]["values"] == {"bad": None, "loss/pg": 20.0}
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 0
