"""One environment replica on the bus: takes steps, publishes replies. The shell of
``EnvironmentHost``.

It pulls from two durable queues: ``env_steps.any`` (resets, shared by every replica: whoever
takes one owns the episode) and ``env_steps.<owner>`` (the later steps of its own episodes,
so an episode's state stays where it lives). Each step is handled in its own task, up to
``concurrency`` at once, its message kept alive while a slow tool runs; the reply goes to
``env_replies.<episode>`` with an id per (episode, attempt, turn), so a redelivered step's
reply is dropped by the bus's dedupe. A step is acked only after its reply is stored: a replica
killed mid-step leaves it to be redelivered, and the engine learns the episode is ``lost``.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from dora.aio import cancel_all
from dora.bus import Bus, ConsumerSpec, Message
from dora.envs.host import EnvironmentHost
from dora.events import EnvReply, EnvStep
from dora.stage.deadletter import dead_letter, parse_event
from dora.stage.pull import Puller
from dora.subjects import episode_token

log = structlog.get_logger(__name__)

ANY = "any"
ACK_WAIT_S = 30.0


def reply_event_id(reply: EnvReply) -> str:
    return f"reply-{episode_token(reply.episode_id)}-{reply.attempt}-{reply.turn}"


def step_event_id(step: EnvStep) -> str:
    return f"step-{episode_token(step.episode_id)}-{step.attempt}-{step.turn}"


class EnvironmentService:
    """Serves ``host`` on the bus; ``await run()`` until ``stop()``."""

    def __init__(self, host: EnvironmentHost, bus: Bus, concurrency: int = 64) -> None:
        self.host = host
        self.bus = bus
        self.concurrency = concurrency
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._freed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._log = log.bind(owner=host.owner)

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        subjects = self.bus.subjects
        specs = [
            ConsumerSpec(f"env-{ANY}", subjects.env_steps(ANY), self.concurrency * 4),
            ConsumerSpec(f"env-{self.host.owner}", subjects.env_steps(self.host.owner)),
        ]
        pullers = [Puller(await self.bus.consumer(s), self.host.owner) for s in specs]
        self.ready.set()
        loops = [asyncio.create_task(self._pull(p)) for p in pullers]
        loops.append(asyncio.create_task(self._reap()))
        try:
            await self._stop.wait()
        finally:
            await cancel_all(loops)
            await cancel_all(list(self._tasks))
            await self.host.close()
            for puller in pullers:
                await puller.consumer.close()

    async def _pull(self, puller: Puller) -> None:
        while True:
            room = self.concurrency - len(self._tasks)
            if room <= 0:
                self._freed.clear()
                await self._freed.wait()
                continue
            for msg in await puller.fetch(room, 1.0):
                task = asyncio.create_task(self._handle(msg))
                self._tasks.add(task)
                task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._freed.set()
        if not task.cancelled() and task.exception() is not None:
            self._log.error("step_failed", error=repr(task.exception()))

    async def _handle(self, msg: Message) -> None:
        step, reason = parse_event(EnvStep, msg.data)
        if step is None:
            await dead_letter(self.bus, msg, f"environment:{self.host.owner}", reason)
            return
        beat = asyncio.create_task(self._keep_alive(msg))
        try:
            reply = await self.host.handle(step)
        finally:
            beat.cancel()
        reply = reply.model_copy(update={"event_id": reply_event_id(reply)})
        await self.bus.publish_event(self.bus.subjects.env_replies(step.episode_id), reply)
        await msg.ack()

    @staticmethod
    async def _keep_alive(msg: Message) -> None:
        """A slow tool must not make its step look abandoned (redelivered elsewhere)."""
        with contextlib.suppress(Exception):
            while True:
                await asyncio.sleep(ACK_WAIT_S / 3)
                await msg.in_progress()

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(self.host.episode_timeout_s / 4, 30.0))
            if reaped := await self.host.reap():
                self._log.info("idle_episodes_closed", count=reaped)
