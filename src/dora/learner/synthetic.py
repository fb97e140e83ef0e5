"""Synthetic scored trajectories for tests, benchmarks and smoke runs of the learner.

``make_scored`` crafts one sample from token ids; ``score_completions`` builds a whole group
from given completions with the model's own behaviour logprobs (so the data is exactly
on-policy for that model), which is what a learning test needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dora.events import (
    Prompt,
    RolloutRequest,
    SamplingParams,
    ScoredTrajectory,
    Trajectory,
    new_id,
)
from dora.models import LlamaModel


def make_scored(
    *,
    group_id: str,
    group_index: int,
    group_size: int,
    version: int = 0,
    reward: float = 0.0,
    prompt_ids: Sequence[int] = (1, 10, 11),
    completion_ids: Sequence[int] = (12, 13),
    logprobs: Sequence[float] | None = None,
    loss_mask: Sequence[int] | None = None,
    correct: bool | None = None,
    temperature: float = 1.0,
    request_id: str | None = None,
) -> ScoredTrajectory:
    """One scored sample of group ``group_id`` (behaviour logprobs default to -1.0)."""
    n = len(completion_ids)
    request = RolloutRequest(
        request_id=request_id or f"{group_id}-{group_index}",
        prompt=Prompt(prompt_id=group_id, text="synthetic"),
        prompt_token_ids=tuple(prompt_ids),
        group_id=group_id,
        group_index=group_index,
        group_size=group_size,
        sampling=SamplingParams(temperature=temperature, max_tokens=max(n, 1)),
        version=version,
    )
    traj = Trajectory(
        request=request,
        version=version,
        prompt_token_ids=tuple(prompt_ids),
        completion_token_ids=tuple(completion_ids),
        logprobs=tuple(float(x) for x in (logprobs if logprobs is not None else [-1.0] * n)),
        loss_mask=tuple(loss_mask if loss_mask is not None else [1] * n),
        finish_reason="stop",
    )
    return ScoredTrajectory(
        trajectory=traj,
        reward=float(reward),
        correct=bool(reward > 0) if correct is None else correct,
    )


@torch.no_grad()
def behaviour_logprobs(
    model: LlamaModel, prompt_ids: Sequence[int], completion_ids: Sequence[int]
) -> list[float]:
    """Logprob of each completion token under ``model`` (temperature 1)."""
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=model.device)
    logits = model(ids)[0, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    targets = ids[0, 1:]
    chosen = logp.gather(-1, targets[:, None]).squeeze(-1)
    return chosen[len(prompt_ids) - 1 :].tolist()


def score_completions(
    model: LlamaModel,
    *,
    group_id: str,
    prompt_ids: Sequence[int],
    completions: Sequence[Sequence[int]],
    rewards: Sequence[float],
    version: int = 0,
) -> list[ScoredTrajectory]:
    """A full group with on-policy behaviour logprobs from ``model``."""
    if len(completions) != len(rewards):
        raise ValueError(f"{len(completions)} completions but {len(rewards)} rewards")
    return [
        make_scored(
            group_id=group_id,
            group_index=i,
            group_size=len(completions),
            version=version,
            reward=r,
            prompt_ids=prompt_ids,
            completion_ids=c,
            logprobs=behaviour_logprobs(model, prompt_ids, c),
            request_id=f"{group_id}-{i}-{new_id()[:8]}",
        )
        for i, (c, r) in enumerate(zip(completions, rewards, strict=True))
    ]
