"""The learner stage builds the KL term's reference policy: the start model, frozen."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from dora.bus import MemoryBus
from dora.models import build_model, save_pretrained
from dora.stage.context import Context
from dora.stages.learner import LearnerStage
from dora.subjects import Subjects


async def _set_up(tmp_path: Path, grpo: dict[str, float]) -> LearnerStage:
    model, tok = build_model("tiny", seed=3, num_hidden_layers=1)
    model_dir = save_pretrained(model, tmp_path / "model", tok)
    stage = LearnerStage(
        model={"path": str(model_dir)},
        learner={"batch_groups": 1, "max_steps": 1, "tensorboard": False, "grpo": grpo},
        eval={"set": {"per_stratum": 0}},
    )
    bus = MemoryBus(Subjects("kl"))
    await bus.connect()
    ctx = Context(stage, bus, run_dir=tmp_path / "run")
    await asyncio.wait_for(stage.setup(ctx), 30)
    stage.stop_event.set()
    await asyncio.wait_for(stage.task, 30)
    return stage


async def test_kl_coef_trains_against_the_frozen_start_policy(tmp_path: Path) -> None:
    stage = await _set_up(tmp_path, {"kl_coef": 0.1})
    trainer = stage.service.core.trainer
    ref = trainer.ref_model
    assert ref is not None and ref is not trainer.model
    assert not any(p.requires_grad for p in ref.parameters())
    start = trainer.model.state_dict()
    for name, tensor in ref.state_dict().items():
        assert torch.equal(tensor, start[name]), name


async def test_no_reference_is_loaded_without_a_kl_term(tmp_path: Path) -> None:
    stage = await _set_up(tmp_path, {"kl_coef": 0.0})
    assert stage.service.core.trainer.ref_model is None
