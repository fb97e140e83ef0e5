"""The environment side of episodes: one replica's live environments, answering steps. No bus.

``EnvironmentHost.handle(step) -> reply`` is the whole contract (the stage around it,
``dora.stages.environment``, moves the events). A reset (turn 0) builds a fresh environment,
deadlines included (``Guarded``); each later step goes to the episode's instance. A step is
idempotent per (episode, attempt, turn): a redelivered one gets the reply already given and
never runs a tool twice. A step for an episode this replica does not hold (it restarted, or
another replica owned it) is answered ``lost``, so the engine retries the episode on a fresh
environment instead of waiting. Episodes nobody stepped for ``episode_timeout_s`` are closed
(their engine died or retried elsewhere).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from dora.envs.base import AssistantTurn, Environment
from dora.envs.guard import EnvironmentFailed, Guarded
from dora.events import EnvReply, EnvStep

Key = tuple[str, int, int]
"""(episode, attempt, turn): what a step is idempotent on."""


@dataclass
class _Live:
    env: Guarded
    attempt: int
    turn: int = 0
    touched: float = field(default_factory=time.monotonic)


@dataclass
class HostStats:
    episodes: int = 0
    steps: int = 0
    replayed: int = 0
    """Redelivered steps answered from the cache (no tool ran twice)."""
    lost: int = 0
    failed: int = 0
    reaped: int = 0


class EnvironmentHost:
    """One replica's episodes (see module docstring)."""

    def __init__(
        self,
        owner: str,
        environment: str,
        make: Callable[[], Environment],
        *,
        step_timeout_s: float = 60.0,
        episode_timeout_s: float = 600.0,
        remember: int = 4096,
    ) -> None:
        self.owner = owner
        self.environment = environment
        self.make = make
        self.step_timeout_s = step_timeout_s
        self.episode_timeout_s = episode_timeout_s
        self.live: dict[str, _Live] = {}
        self.stats = HostStats()
        self._answered: OrderedDict[Key, EnvReply] = OrderedDict()
        self._remember = remember
        self._locks: dict[str, asyncio.Lock] = {}

    async def handle(self, step: EnvStep) -> EnvReply:
        """The reply to ``step``; never raises for anything the model or environment did."""
        key = (step.episode_id, step.attempt, step.turn)
        lock = self._locks.setdefault(step.episode_id, asyncio.Lock())
        async with lock:  # a redelivered step may arrive while the first is still running
            if key in self._answered:
                self.stats.replayed += 1
                return self._answered[key]
            reply = await self._answer(step)
            self._answered[key] = reply
            while len(self._answered) > self._remember:
                self._answered.popitem(last=False)
        if step.episode_id not in self.live:
            self._locks.pop(step.episode_id, None)
        return reply

    async def _answer(self, step: EnvStep) -> EnvReply:
        if step.environment != self.environment:
            return self._reply(
                step,
                done=True,
                error=f"{self.owner} serves {self.environment!r}, not {step.environment!r}",
            )
        if step.turn == 0:
            return await self._reset(step)
        live = self.live.get(step.episode_id)
        if live is None or live.attempt != step.attempt or step.turn != live.turn + 1:
            self.stats.lost += 1
            return self._reply(
                step,
                lost=True,
                error=f"{self.owner} does not hold episode {step.episode_id!r} attempt "
                f"{step.attempt} before turn {step.turn} (restarted, or moved on)",
            )
        live.touched = time.monotonic()
        result = await live.env.step(AssistantTurn(step.text, truncated=step.truncated))
        self.stats.steps += 1
        live.turn = step.turn
        done = result.done or step.truncated or bool(result.error)
        if done:
            await self._close(step.episode_id)
            self.stats.failed += bool(result.error)
        return self._reply(
            step,
            messages=() if done else tuple(result.messages),
            done=done,
            reward=result.reward,
            metrics=result.metrics,
            error=result.error,
        )

    async def _reset(self, step: EnvStep) -> EnvReply:
        await self._close(step.episode_id)  # an earlier attempt's instance, if here
        env = Guarded(self.make(), self.step_timeout_s, self.episode_timeout_s)
        try:
            messages = await env.reset(step.prompt, step.seed)
        except EnvironmentFailed as exc:
            await env.close()
            self.stats.failed += 1
            return self._reply(step, done=True, error=str(exc))
        self.live[step.episode_id] = _Live(env, step.attempt)
        self.stats.episodes += 1
        return self._reply(step, messages=tuple(messages))

    def _reply(self, step: EnvStep, **fields: object) -> EnvReply:
        return EnvReply(
            episode_id=step.episode_id,
            attempt=step.attempt,
            turn=step.turn,
            owner=self.owner,
            **fields,  # type: ignore[arg-type]
        )

    async def _close(self, episode_id: str) -> None:
        live = self.live.pop(episode_id, None)
        if live is not None:
            await live.env.close()

    async def reap(self) -> int:
        """Close episodes idle past ``episode_timeout_s``; how many."""
        cutoff = time.monotonic() - self.episode_timeout_s
        stale = [eid for eid, live in self.live.items() if live.touched <= cutoff]
        for eid in stale:
            await self._close(eid)
            self._locks.pop(eid, None)
        self.stats.reaped += len(stale)
        return len(stale)

    async def close(self) -> None:
        for eid in list(self.live):
            await self._close(eid)
