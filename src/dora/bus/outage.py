"""Riding out a NATS server that went away: retry until it is back, for a bounded time.

nats-py reconnects by itself, but every JetStream call made meanwhile (a publish waiting for
its ack, a KV read, a consumer's info) fails after its 10 s timeout, and a stage that sees
the error stops the run. ``Outage`` wraps those calls: a failure that means "the server is
not there (yet)" is retried with backoff while the bus has been failing for less than
``outage_s``; then the call raises ``BusUnavailable`` naming NATS, the URL and how long it
waited. Any success ends the outage. Publishes are retried only with a message id, so the
server's deduplication makes the retry safe.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors
import structlog

from dora.bus.base import BusError

log = structlog.get_logger(__name__)

T = TypeVar("T")

DEFAULT_OUTAGE_S = 120.0
"""How long a run waits for a lost NATS server before it fails (``DORA_NATS_OUTAGE_S``)."""

TRANSIENT: tuple[type[BaseException], ...] = (
    TimeoutError,  # nats.errors.TimeoutError is one too
    nats.errors.NoServersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.NoRespondersError,  # JetStream's API not up yet after a restart
    nats.js.errors.ServiceUnavailableError,
)
"""Errors that mean the server is away or still starting, not that the call is wrong."""


class BusUnavailable(BusError):
    """The NATS server stayed unreachable for longer than the bus rides out."""


class Outage:
    """Shared by one bus's calls: when the failing started, and whether it was reported."""

    def __init__(self, url: str, outage_s: float = DEFAULT_OUTAGE_S) -> None:
        self.url = url
        self.outage_s = outage_s
        self.since: float | None = None

    def begin(self) -> None:
        """The connection dropped (nats-py's disconnected callback)."""
        if self.since is None:
            self.since = time.monotonic()

    def end(self) -> None:
        if self.since is not None:
            log.info("nats_back", url=self.url, after_s=round(time.monotonic() - self.since, 1))
        self.since = None

    async def call(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """``await op()``, retried through an outage of up to ``outage_s``."""
        delay = 0.05
        while True:
            try:
                result = await op()
            except TRANSIENT as exc:
                await self.wait(what, exc, delay)
                delay = min(delay * 2, 1.0)
                continue
            if self.since is not None:
                self.end()
            return result

    async def wait(self, what: str, exc: BaseException, delay: float) -> None:
        """Sleep ``delay`` after a transient failure, or raise once the outage is too long."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
        waited = now - self.since
        cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if waited >= self.outage_s:
            raise BusUnavailable(
                f"NATS at {self.url} unreachable for {waited:.0f} s ({what}: {cause}); "
                f"is the server running? (rides out {self.outage_s:.0f} s: DORA_NATS_OUTAGE_S)"
            ) from exc
        log.debug("nats_retry", url=self.url, what=what, waited_s=round(waited, 1), error=cause)
        await asyncio.sleep(delay)


def outage_s_from_env() -> float:
    """``DORA_NATS_OUTAGE_S`` if set (seconds), else ``DEFAULT_OUTAGE_S``."""
    raw = os.environ.get("DORA_NATS_OUTAGE_S")
    if not raw:
        return DEFAULT_OUTAGE_S
    try:
        value = float(raw)
    except ValueError:
        raise BusError(f"DORA_NATS_OUTAGE_S={raw!r}: not a number of seconds") from None
    if value < 0:
        raise BusError(f"DORA_NATS_OUTAGE_S={raw!r}: must be >= 0")
    return value
