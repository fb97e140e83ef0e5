"""A conversation with tools: the model calls tools until it answers, then it is scored.

Each assistant turn is searched for tool calls (``dora.envs.tools``). Calls are run in order
and each result comes back as a ``tool`` message; a turn with mistakes in it gets one ``tool``
message per mistake, so the model sees what went wrong and may try again. A turn with no
attempted call is the final answer: the episode ends and ``score`` (if any) gives its reward.
An episode also ends after ``max_turns`` assistant turns.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from dora.envs.base import AssistantTurn, ChatMessage, StepResult
from dora.envs.tools import ToolSet, parse_tool_calls
from dora.events import Prompt

Score = Callable[[Prompt, str], float | Awaitable[float]]

TOOLS_PREAMBLE = (
    "You may call these tools. To call one, write "
    '<tool_call>{"name": NAME, "arguments": {...}}</tool_call> and wait for its result.\n'
)


class ToolEnvironment:
    """One episode of ``prompt`` with ``tools`` (see module docstring)."""

    def __init__(
        self,
        tools: ToolSet,
        *,
        system: str = "",
        score: Score | None = None,
        max_turns: int = 8,
        list_tools: bool = True,
    ) -> None:
        """``list_tools``: put the tools' schemas in the system message (a model trained on a
        fixed tool set may not need them)."""
        self.tools = tools
        self.system = system
        self.score = score
        self.max_turns = max_turns
        self.list_tools = list_tools
        self.prompt: Prompt | None = None
        self.turns = 0

    async def reset(self, prompt: Prompt, seed: int) -> list[ChatMessage]:
        self.prompt, self.turns = prompt, 0
        system = self.system
        if self.list_tools and self.tools.tools:
            listing = "\n".join(json.dumps(spec) for spec in self.tools.specs())
            system = f"{system}\n{TOOLS_PREAMBLE}{listing}".strip()
        opening = [ChatMessage(role="system", content=system)] if system else []
        return [*opening, ChatMessage(role="user", content=prompt.text)]

    async def step(self, turn: AssistantTurn) -> StepResult:
        self.turns += 1
        parsed = parse_tool_calls(turn.text, truncated=turn.truncated, turn=self.turns)
        metrics = {
            "tool_calls": float(len(parsed.calls)),
            "tool_call_errors": float(len(parsed.errors)),
        }
        if not parsed.attempted or self.turns >= self.max_turns:
            return StepResult(done=True, reward=await self._score(turn.text), metrics=metrics)
        messages = [ChatMessage(role="tool", content=f"error: {e}") for e in parsed.errors]
        seconds = 0.0
        for call in parsed.calls:
            result = await self.tools.run(call)
            seconds += result.seconds
            metrics["tool_failures"] = metrics.get("tool_failures", 0.0) + (not result.ok)
            messages.append(
                ChatMessage(
                    role="tool", content=result.content, name=call.name, tool_call_id=call.id
                )
            )
        metrics["tool_seconds"] = seconds
        return StepResult(messages=messages, metrics=metrics)

    async def close(self) -> None:
        self.prompt = None

    async def _score(self, answer: str) -> float | None:
        if self.score is None or self.prompt is None:
            return None
        value = self.score(self.prompt, answer)
        return float(await value) if isinstance(value, Awaitable) else float(value)
