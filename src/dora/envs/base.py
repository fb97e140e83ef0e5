"""What an environment is: one instance per episode that reacts to the model's turns.

The generator owns the loop (it samples a turn, hands it over, appends the reply's tokens and
goes on decoding); an environment only reacts. Messages are OpenAI-format chat messages, the
shape every agent framework already speaks. An environment never raises on bad model output:
a malformed tool call, an unknown tool or bad arguments become a message to the model, and an
environment that fails itself ends the episode with its error in ``StepResult.error``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from dora.events import ChatMessage, Prompt

Role = Literal["system", "user", "assistant", "tool"]
__all__ = ["AssistantTurn", "ChatMessage", "Environment", "Role", "StepResult"]


@dataclass(frozen=True)
class AssistantTurn:
    """What the model produced in one turn. ``truncated``: cut off by the length limit (a tool
    call in it may be incomplete and is never executed)."""

    text: str
    truncated: bool = False


@dataclass
class StepResult:
    """The environment's reply to one assistant turn."""

    messages: list[ChatMessage] = field(default_factory=list)
    """Appended to the conversation (tool results, the user's next message); empty when done."""
    done: bool = False
    reward: float | None = None
    """The episode's reward when ``done`` (None: leave it to the run's verifier)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-turn numbers kept on the trajectory (tool calls, parse errors, tool seconds)."""
    error: str = ""
    """The environment itself failed: the episode ends and the trajectory says why."""


@runtime_checkable
class Environment(Protocol):
    """One episode. All methods are async; none raises on bad model output."""

    async def reset(self, prompt: Prompt, seed: int) -> list[ChatMessage]:
        """The conversation's opening messages for ``prompt``."""
        ...

    async def step(self, turn: AssistantTurn) -> StepResult:
        """React to one assistant turn."""
        ...

    async def close(self) -> None:
        """Release what the episode holds (a sandbox, a connection)."""
        ...
