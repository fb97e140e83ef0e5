"""Deadlines around an environment, so no episode hangs and no environment error escapes.

``Guarded(env)`` bounds every call: a ``step`` that runs past ``step_timeout_s``, or past
what is left of ``episode_timeout_s``, or that raises, ends the episode with the reason in
``StepResult.error`` (the trajectory is kept with its error, never dropped). A ``reset`` that
fails raises ``EnvironmentFailed``: nothing was generated yet, so the caller may retry once
with a fresh environment (same version and seed). ``close`` never raises and never blocks
past its deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog

from dora.envs.base import AssistantTurn, ChatMessage, Environment, StepResult
from dora.events import Prompt

log = structlog.get_logger(__name__)
T = TypeVar("T")


class EnvironmentFailed(Exception):
    """The environment could not start an episode (timed out or raised in ``reset``)."""


class Guarded:
    """``env`` with step and episode deadlines (see module docstring)."""

    def __init__(
        self, env: Environment, step_timeout_s: float = 60.0, episode_timeout_s: float = 600.0
    ) -> None:
        self.env = env
        self.step_timeout_s = step_timeout_s
        self.episode_timeout_s = episode_timeout_s
        self._deadline = float("inf")

    def _budget(self) -> float:
        return min(self.step_timeout_s, self._deadline - time.monotonic())

    async def _bounded(self, call: Coroutine[Any, Any, T], what: str) -> T:
        budget = self._budget()
        if budget <= 0:
            call.close()  # never started
            raise TimeoutError(f"episode ran past its {self.episode_timeout_s:g} s deadline")
        try:
            return await asyncio.wait_for(call, budget)
        except TimeoutError:
            raise TimeoutError(f"{what} took longer than {budget:.3g} s") from None

    async def reset(self, prompt: Prompt, seed: int) -> list[ChatMessage]:
        self._deadline = time.monotonic() + self.episode_timeout_s
        try:
            return await self._bounded(self.env.reset(prompt, seed), "reset")
        except Exception as exc:
            raise EnvironmentFailed(f"{type(exc).__name__}: {exc}") from exc

    async def step(self, turn: AssistantTurn) -> StepResult:
        try:
            return await self._bounded(self.env.step(turn), "step")
        except Exception as exc:  # the environment failed, not the model: end the episode
            log.warning("environment_step_failed", error=f"{type(exc).__name__}: {exc}")
            return StepResult(done=True, error=f"{type(exc).__name__}: {exc}")

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.env.close(), self.step_timeout_s)
        except Exception as exc:
            log.warning("environment_close_failed", error=f"{type(exc).__name__}: {exc}")
