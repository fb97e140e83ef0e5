"""Synchronous gym-style text environments (SkyRL-gym, rLLM) as dora environments.

Users already have environments of this shape::

    env.reset(seed=...)  -> observation            or (observation, info)
    env.step(action)     -> (observation, reward, done, info)
                         or (observation, reward, terminated, truncated, info)
    env.close()          (optional)

Their calls block, so they run in one bounded thread pool shared by every episode of the
process (``max_workers``): a slow environment cannot starve the event loop, and a hundred of
them cannot start a hundred threads. An environment that raises ends its episode with the
error (``StepResult.error``); it never takes the generator down.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dora.envs.base import AssistantTurn, ChatMessage, StepResult
from dora.events import Prompt

DEFAULT_WORKERS = 8
_pool: ThreadPoolExecutor | None = None


def gym_pool(max_workers: int = DEFAULT_WORKERS) -> ThreadPoolExecutor:
    """The process's pool for blocking environment calls (created on first use)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers, thread_name_prefix="gym-env")
    return _pool


def _observation(value: Any) -> str:
    return value if isinstance(value, str) else str(value)


class GymTextEnvironment:
    """Adapts one gym-style environment, built per episode by ``make(prompt)``."""

    def __init__(self, make: Callable[[Prompt], Any], *, role: str = "user") -> None:
        """``role``: how observations reach the model (``user`` or ``tool``)."""
        self.make = make
        self.role = role
        self.env: Any = None
        self.total = 0.0
        """The episode's return so far (the sum of per-step rewards)."""

    async def _call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(gym_pool(), lambda: fn(*args, **kw))

    async def reset(self, prompt: Prompt, seed: int) -> list[ChatMessage]:
        self.env, self.total = await self._call(self.make, prompt), 0.0
        out = await self._call(self.env.reset, seed=seed)
        observation = out[0] if isinstance(out, tuple) else out
        return [ChatMessage(role="user", content=_observation(observation))]

    async def step(self, turn: AssistantTurn) -> StepResult:
        try:
            out = await self._call(self.env.step, turn.text)
        except Exception as exc:
            return StepResult(done=True, error=f"environment failed: {type(exc).__name__}: {exc}")
        if len(out) == 5:
            observation, reward, terminated, truncated, info = out
            done = bool(terminated or truncated)
        else:
            observation, reward, done, info = out
        metrics = {k: float(v) for k, v in (info or {}).items() if isinstance(v, int | float)}
        metrics["turn_reward"] = float(reward or 0.0)
        self.total += metrics["turn_reward"]
        if done:
            return StepResult(done=True, reward=self.total, metrics=metrics)
        message = ChatMessage(role=self.role, content=_observation(observation))  # type: ignore[arg-type]
        return StepResult(messages=[message], metrics=metrics)

    async def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await self._call(close)
