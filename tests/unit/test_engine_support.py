"""Builders shared by the engine tests (tiny preset, 2 layers: fast on one CPU core); no tests."""

from __future__ import annotations

import torch

from dora.engines import Engine
from dora.engines.torch import EngineConfig, TorchEngine
from dora.events import Prompt, ResumeState, RolloutRequest, SamplingParams, Trajectory

torch.set_num_threads(1)


def make_engine(engine_id: str = "e0", version: int = 0, **config: object) -> TorchEngine:
    cfg = EngineConfig(**{"num_blocks": 512, **config})  # type: ignore[arg-type]
    return TorchEngine.from_preset(
        "tiny", seed=0, config=cfg, engine_id=engine_id, version=version, num_hidden_layers=2
    )


def make_request(
    rid: str,
    text: str = "What is 2 + 3? Answer:",
    version: int = 0,
    resume: ResumeState | None = None,
    prompt_token_ids: tuple[int, ...] = (),
    **sampling: object,
) -> RolloutRequest:
    params = {"temperature": 0.0, "max_tokens": 16, **sampling}
    return RolloutRequest(
        request_id=rid,
        prompt=Prompt(prompt_id="p-" + rid, text=text),
        prompt_token_ids=prompt_token_ids,
        group_id="g-" + rid,
        group_index=0,
        version=version,
        sampling=SamplingParams(**params),  # type: ignore[arg-type]
        resume=resume,
    )


def run_all(engine: Engine, max_steps: int = 20_000) -> dict[str, Trajectory]:
    """Step an engine (any kind) until it holds no work; its trajectories by request id."""
    out: dict[str, Trajectory] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for t in engine.step():
            out[t.request.request_id] = t
    assert not engine.has_work(), "engine did not finish"
    return out


def run_alone(request: RolloutRequest, **config: object) -> Trajectory:
    engine = make_engine(**config)
    engine.add_request(request)
    return run_all(engine)[request.request_id]
