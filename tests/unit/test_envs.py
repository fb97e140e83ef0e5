"""Environments: tool schemas from signatures, tool calls parsed and run without raising, the
tool environment's episode, and the gym-style adapter."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Literal

import pytest

from dora.envs import (
    CALCULATOR,
    AssistantTurn,
    GymTextEnvironment,
    ToolCall,
    ToolEnvironment,
    ToolSet,
    environment_names,
    make_environment,
    parse_tool_calls,
    tool,
)
from dora.events import Prompt
from dora.tasks.base import TaskConfigError


@tool
def lookup(order_id: str, fields: list[str] | None = None, mode: Literal["a", "b"] = "a") -> dict:
    """Find an order by its id.

    Args:
        order_id: The order's id, e.g. "A-17".
        fields: Which fields to return (all when omitted).
        mode: How to look.

    Returns:
        The order.
    """
    return {"id": order_id, "fields": fields, "mode": mode}


@tool(timeout_s=0.2)
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return "done"


@tool
def broken(x: int) -> str:
    """Always fails."""
    raise RuntimeError("database down")


def call(text: str) -> str:
    return f"<tool_call>{text}</tool_call>"


def test_schema_comes_from_the_signature_and_the_docstring() -> None:
    spec = lookup.spec()["function"]
    assert spec["name"] == "lookup"
    assert spec["description"] == "Find an order by its id."
    params = spec["parameters"]
    assert params["required"] == ["order_id"]
    assert params["properties"]["order_id"] == {
        "type": "string",
        "description": 'The order\'s id, e.g. "A-17".',
    }
    assert params["properties"]["mode"]["enum"] == ["a", "b"]
    assert "Returns" not in str(params) and params["additionalProperties"] is False


def test_an_unannotated_argument_is_refused_at_definition() -> None:
    with pytest.raises(TypeError, match="'x' has no type annotation"):

        @tool
        def untyped(x):  # type: ignore[no-untyped-def]
            return x


def test_calls_are_parsed_and_a_cut_off_call_is_never_run() -> None:
    text = (
        "Let me look. "
        + call('{"name": "lookup", "arguments": {"order_id": "A-1"}}')
        + call('{"name": "lookup", "arguments": "{\\"order_id\\": \\"A-2\\"}"}')
        + call("not json")
        + call('["lookup"]')
        + '<tool_call>{"name": "lookup", "argu'
    )
    parsed = parse_tool_calls(text, truncated=True)
    assert [c.arguments for c in parsed.calls] == [{"order_id": "A-1"}, {"order_id": "A-2"}]
    assert len({c.id for c in parsed.calls}) == 2
    assert len(parsed.errors) == 3
    assert "not valid JSON" in parsed.errors[0]
    assert "cut off by the length limit" in parsed.errors[2]
    assert "never closed" in parse_tool_calls("<tool_call>{}", truncated=False).errors[0]
    assert not parse_tool_calls("The answer is 4.").attempted


async def test_every_failure_is_a_message_for_the_model() -> None:
    tools = ToolSet([lookup, slow, broken])
    ok = await tools.run(ToolCall("c1", "lookup", {"order_id": "A-1", "mode": "b"}))
    assert ok.ok and '"mode": "b"' in ok.content
    cases = [
        (ToolCall("c2", "nope", {}), "unknown tool 'nope'"),
        (ToolCall("c3", "lookup", {"order_id": 7}), "order_id: 7 is not of type 'string'"),
        (ToolCall("c4", "lookup", {"order_id": "A", "mode": "z"}), "mode: 'z' is not one of"),
        (ToolCall("c5", "lookup", {"order_id": "A", "extra": 1}), "'extra' was unexpected"),
        (ToolCall("c6", "slow", {"seconds": 5}), "timed out after 0.2 s"),
        (ToolCall("c7", "broken", {"x": 1}), "RuntimeError: database down"),
    ]
    started = time.monotonic()
    for bad, expected in cases:
        result = await tools.run(bad)
        assert not result.ok and result.content.startswith("error:")
        assert expected in result.content, result.content
    assert time.monotonic() - started < 3  # the timed-out tool did not hold the caller


async def test_calculator_is_exact_and_refuses_what_is_not_arithmetic() -> None:
    tools = ToolSet([CALCULATOR])

    async def calc(expression: str) -> str:
        return (await tools.run(ToolCall("c", "calculator", {"expression": expression}))).content

    assert await calc("3 * (4 + 5) - 2**10") == "-997"
    assert await calc("7 / 2") == "3.5"
    assert await calc("0.1 + 0.2") == "0.3"
    for bad in ("__import__('os')", "x + 1", "2 ** 1000", "1/0", "3 +"):
        assert (await calc(bad)).startswith("error:"), bad


def prompt(text: str = "What is 12 * 34?", answer: str = "408") -> Prompt:
    return Prompt(prompt_id="p1", task="arithmetic", text=text, answer=answer)


async def test_a_tool_episode_runs_until_the_answer_and_is_scored() -> None:
    env = make_environment("calculator", max_turns=4)
    opening = await env.reset(prompt(), seed=0)
    assert [m.role for m in opening] == ["system", "user"]
    assert '"name": "calculator"' in opening[0].content
    first = await env.step(
        AssistantTurn(call('{"name": "calculator", "arguments": {"expression": "12*34"}}'))
    )
    assert not first.done and [m.content for m in first.messages] == ["408"]
    assert first.messages[0].role == "tool" and first.messages[0].tool_call_id
    assert first.metrics["tool_calls"] == 1
    bad = await env.step(AssistantTurn(call('{"name": "calculator"') + "</tool_call>"))
    assert not bad.done and bad.messages[0].content.startswith("error:")
    final = await env.step(AssistantTurn("answer: 408"))
    assert final.done and final.reward == 1.0 and not final.messages
    await env.close()
    assert "calculator" in environment_names()
    with pytest.raises(TaskConfigError, match="max_turn"):
        make_environment("calculator", max_turn=3)


async def test_an_episode_ends_after_max_turns() -> None:
    env = ToolEnvironment(ToolSet([CALCULATOR]), max_turns=2)
    await env.reset(prompt(), seed=0)
    turn = AssistantTurn(call('{"name": "calculator", "arguments": {"expression": "1+1"}}'))
    assert not (await env.step(turn)).done
    assert (await env.step(turn)).done


class Guess:
    """A SkyRL-gym style environment: guess the number in three tries."""

    def __init__(self, target: int) -> None:
        self.target, self.tries, self.closed = target, 0, False

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        return f"Guess a number (seed {seed}).", {}

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self.tries += 1
        if action.strip() == "boom":
            raise ValueError("cannot parse")
        hit = action.strip() == str(self.target)
        return ("higher" if not hit else "yes"), float(hit), hit or self.tries >= 3, {"tries": 1}

    def close(self) -> None:
        self.closed = True


async def test_a_gym_style_environment_is_adapted() -> None:
    made: list[Guess] = []

    def make(p: Prompt) -> Guess:
        made.append(Guess(int(p.answer)))
        return made[-1]

    env = GymTextEnvironment(make)
    opening = await env.reset(prompt(answer="5"), seed=3)
    assert opening[0].role == "user" and "seed 3" in opening[0].content
    miss = await env.step(AssistantTurn("4"))
    assert not miss.done and miss.messages[0].content == "higher"
    assert miss.metrics == {"tries": 1.0, "turn_reward": 0.0}
    hit = await env.step(AssistantTurn("5"))
    assert hit.done and hit.reward == 1.0
    await env.close()
    assert made[0].closed

    env = GymTextEnvironment(make)
    await env.reset(prompt(answer="5"), seed=0)
    failed = await env.step(AssistantTurn("boom"))  # the environment raised: never re-raised
    assert failed.done and "ValueError: cannot parse" in failed.error


async def play(env: Any, p: Prompt, turns: list[str]) -> list[Any]:
    await env.reset(p, seed=0)
    results = []
    for text in turns:
        results.append(await env.step(AssistantTurn(text)))
        if results[-1].done:
            break
    await env.close()
    return results


async def test_retail_rewards_exactly_the_goal_read_from_the_final_database() -> None:
    from dora.tasks import make_task

    task = make_task("retail")
    prompts = list(task.prompts("train", 30))
    assert {json.loads(p.answer)["kind"] for p in prompts} == {"cancel", "address", "return"}
    for p in prompts:  # the reference transcript solves every problem
        turns = task.solve(p).split("\n")
        results = await play(make_environment("retail"), p, turns)
        assert results[-1].done and results[-1].reward == 1.0, (p.text, results)
        assert all(r.metrics.get("tool_failures", 0) == 0 for r in results[:-1])

    p = next(p for p in prompts if json.loads(p.answer)["kind"] == "cancel")
    goal = json.loads(p.answer)
    calls = task.solve(p).split("\n")
    wrong = calls[-2].replace(goal["order_id"], "W0000")  # an order that does not exist
    results = await play(make_environment("retail"), p, [*calls[:-2], wrong, "Done."])
    assert "no order 'W0000'" in results[-2].messages[0].content and results[-1].reward == 0.0
    extra = await play(make_environment("retail"), p, [*calls[:-1], calls[-2], "Done."])
    assert extra[-2].messages[0].content.startswith("error:")  # cancelled twice: refused
    assert extra[-1].reward == 1.0  # the refused call changed nothing
    nothing = await play(make_environment("retail"), p, ["Done."])
    assert nothing[-1].reward == 0.0

    train = {p.metadata["db_seed"] for p in task.prompts("train", 200)}
    evals = {p.metadata["db_seed"] for p in task.prompts("eval", 50)}
    assert not train & evals  # split by problem identity


class Stuck:
    """An environment that hangs or raises where it is told to."""

    def __init__(self, hang_in: str = "", raise_in: str = "", step_s: float = 0.0) -> None:
        self.hang_in, self.raise_in, self.step_s, self.closed = hang_in, raise_in, step_s, False

    async def _act(self, where: str) -> None:
        if self.raise_in == where:
            raise RuntimeError(f"{where} broke")
        if self.hang_in == where:
            await asyncio.sleep(3600)

    async def reset(self, p: Prompt, seed: int) -> list[Any]:
        await self._act("reset")
        return []

    async def step(self, turn: AssistantTurn) -> Any:
        await self._act("step")
        await asyncio.sleep(self.step_s)
        from dora.envs import StepResult

        return StepResult(messages=[])

    async def close(self) -> None:
        await self._act("close")
        self.closed = True


async def test_guarded_environments_end_episodes_instead_of_hanging_or_raising() -> None:
    from dora.envs.guard import EnvironmentFailed, Guarded

    started = time.monotonic()
    with pytest.raises(EnvironmentFailed, match=r"reset took longer than 0\.2 s"):
        await Guarded(Stuck(hang_in="reset"), step_timeout_s=0.2).reset(prompt(), 0)
    with pytest.raises(EnvironmentFailed, match="RuntimeError: reset broke"):
        await Guarded(Stuck(raise_in="reset")).reset(prompt(), 0)

    hung = Guarded(Stuck(hang_in="step"), step_timeout_s=0.2)
    await hung.reset(prompt(), 0)
    result = await hung.step(AssistantTurn("x"))
    assert result.done and "step took longer than 0.2 s" in result.error
    broken = Guarded(Stuck(raise_in="step"))
    await broken.reset(prompt(), 0)
    assert (await broken.step(AssistantTurn("x"))).error == "RuntimeError: step broke"

    slow = Guarded(Stuck(step_s=0.15), step_timeout_s=1.0, episode_timeout_s=0.4)
    await slow.reset(prompt(), 0)
    outcomes = [await slow.step(AssistantTurn("x")) for _ in range(4)]
    assert not outcomes[0].done and outcomes[-1].done  # the episode's deadline ended it
    assert "took longer than" in outcomes[-1].error or "deadline" in outcomes[-1].error

    await Guarded(Stuck(hang_in="close"), step_timeout_s=0.2).close()  # bounded, no raise
    await Guarded(Stuck(raise_in="close")).close()
    assert time.monotonic() - started < 3
