"""RewardService: concurrent scoring, verifier by task, crash/timeout -> reward 0 with error."""

from __future__ import annotations

import os
import time

import pytest

from dora.events import Prompt, RolloutRequest, Trajectory
from dora.rewards import OverlongShaping, RewardService, VerifierResult
from dora.tasks import make_task


def _trajectory(prompt: Prompt, text: str, n_tokens: int | None = None) -> Trajectory:
    n = len(text) if n_tokens is None else n_tokens
    request = RolloutRequest(
        request_id=f"r-{prompt.prompt_id}", prompt=prompt, group_id="g", group_index=0, version=0
    )
    return Trajectory(
        request=request,
        version=0,
        prompt_token_ids=(1,),
        completion_token_ids=tuple([5] * n),
        logprobs=tuple([0.0] * n),
        loss_mask=tuple([1] * n),
        text=text,
        finish_reason="stop",
    )


class Raises:
    name = "raises"
    heavy = True

    def verify(self, completion: str, prompt: Prompt) -> VerifierResult:
        raise RuntimeError("verifier bug")


class Sleeps:
    name = "sleeps"

    def __init__(self, heavy: bool) -> None:
        self.heavy = heavy

    def verify(self, completion: str, prompt: Prompt) -> VerifierResult:
        time.sleep(30)  # stands in for a hung sympy call
        return VerifierResult(1.0, True, {})


class Exits:
    name = "exits"
    heavy = True

    def verify(self, completion: str, prompt: Prompt) -> VerifierResult:
        os._exit(3)  # a worker that dies outright


async def test_scores_by_task_concurrently() -> None:
    arith, count = make_task("arithmetic"), make_task("countdown")
    prompts = [*arith.prompts("train", 3), *count.prompts("train", 3)]
    math = Prompt(prompt_id="m", text="q", answer="\\frac{1}{2}", task="math")
    trajectories = [
        _trajectory(p, (arith if p.task == "arithmetic" else count).solve(p)) for p in prompts
    ]
    trajectories += [_trajectory(math, "\\boxed{0.5}"), _trajectory(prompts[0], "answer: -1")]
    async with RewardService(timeout_s=60) as service:
        scored = await service.score_many(trajectories)
    assert [s.reward for s in scored] == [1.0] * 7 + [0.0]
    assert [s.verifier for s in scored] == ["exact_match"] * 3 + ["countdown"] * 3 + [
        "math",
        "exact_match",
    ]
    assert all(s.error == "" for s in scored)
    assert scored[-1].details["parsed"] == "-1"
    assert [s.trajectory for s in scored] == trajectories


@pytest.mark.parametrize("verifier", [Raises(), Sleeps(heavy=True), Sleeps(heavy=False), Exits()])
async def test_failure_gives_zero_with_error(verifier: object) -> None:
    prompt = make_task("arithmetic").prompt("train", 0)
    good = _trajectory(prompt, make_task("arithmetic").solve(prompt))
    bad_prompt = prompt.model_copy(update={"task": "flaky"})
    bad = _trajectory(bad_prompt, "answer: 1")
    async with RewardService(
        {"arithmetic": "exact_match", "flaky": verifier},  # type: ignore[dict-item]
        timeout_s=1.0,
    ) as service:
        scored = await service.score_many([bad, good])
    assert scored[0].reward == 0.0 and not scored[0].correct
    assert scored[0].error
    assert scored[0].trajectory == bad
    assert scored[1].reward == 1.0 and scored[1].error == ""  # others are unaffected


async def test_unknown_task_and_overlong() -> None:
    prompt = make_task("arithmetic").prompt("train", 0)
    text = make_task("arithmetic").solve(prompt)
    shaping = OverlongShaping(max_length=100, buffer=20, factor=1.0)
    async with RewardService(overlong=shaping) as service:
        unknown = await service.score(_trajectory(prompt.model_copy(update={"task": "x"}), text))
        shaped = await service.score(_trajectory(prompt, text, n_tokens=90))
    assert unknown.reward == 0.0 and "no verifier for task 'x'" in unknown.error
    assert shaped.reward == pytest.approx(0.5)
    assert shaped.details["overlong_penalty"] == pytest.approx(0.5)
    assert shaped.correct


async def test_the_verifier_stage_passes_an_environment_reward_and_zeroes_a_failure() -> None:
    from dora.events import EpisodeRecord
    from dora.learner.synthetic import make_scored
    from dora.stages import VerifierStage

    stage = VerifierStage()
    await stage.setup(None)  # type: ignore[arg-type]
    base = make_scored(group_id="g", group_index=0, group_size=1).trajectory
    episode = EpisodeRecord(environment="retail", turns=3, reward=0.75)
    passed = await stage.handle(base.model_copy(update={"episode": episode}), None)  # type: ignore[arg-type]
    assert passed.reward == 0.75 and passed.correct and passed.verifier == "environment:retail"
    failed = base.model_copy(update={"episode": episode, "error": "environment lost"})
    scored = await stage.handle(failed, None)  # type: ignore[arg-type]
    assert scored.reward == 0.0 and "environment lost" in scored.error
    unscored = base.model_copy(update={"episode": episode.model_copy(update={"reward": None})})
    assert (await stage.handle(unscored, None)).verifier == "exact_match"  # type: ignore[arg-type]
