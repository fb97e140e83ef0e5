"""Pulling from a durable consumer: the one fetch every stage and service uses, and the one
loop of the consumers that only observe.

A fetch rides out a reconnecting bus: an error is logged and retried with backoff instead of
ending the loop (the bus itself waits out an outage before it raises), so no stage or service
pull loop dies silently on a transient failure. What a loop does with the messages (a stage's
handler, a generator's engine, the learner's group buffer) stays with its owner; every
message it gives up on goes through ``dora.stage.deadletter.dead_letter``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from dora.bus import Consumer, Message

log = structlog.get_logger(__name__)

BACKOFF_MAX_S = 5.0


class Puller:
    """Fetches from one consumer; never raises on a failed fetch (logs, backs off, returns [])."""

    def __init__(self, consumer: Consumer, owner: str) -> None:
        self.consumer = consumer
        self.owner = owner
        self.failures = 0

    async def fetch(self, batch: int, timeout: float) -> list[Message]:
        try:
            msgs = await self.consumer.fetch(batch=batch, timeout=timeout)
        except TimeoutError:  # some clients raise instead of returning nothing
            return []
        except Exception as exc:  # a reconnecting bus: keep trying, loudly
            self.failures += 1
            log.warning("fetch_failed", owner=self.owner, error=repr(exc), failures=self.failures)
            await asyncio.sleep(min(0.1 * 2**self.failures, BACKOFF_MAX_S))
            return []
        self.failures = 0
        return msgs


async def observe(
    consumer: Consumer,
    handle: Callable[[list[Message]], Awaitable[None]],
    owner: str,
    *,
    batch: int = 256,
    timeout: float = 1.0,
) -> None:
    """Forever hand each non-empty fetch to ``handle``, which settles every message (ack, or
    dead letter): the loop of an observation consumer (the dispatcher's view of scored
    samples, metrics, weights and dead letters; the orchestrator's of trajectory lengths)."""
    puller = Puller(consumer, owner)
    while True:
        msgs = await puller.fetch(batch, timeout)
        if msgs:
            await handle(msgs)
