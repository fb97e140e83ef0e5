"""What a running stage sees: its run, its bus, a bound logger, and ``publish``/``complete``.

One ``Context`` exists per stage; each message gets a ``for_message`` copy carrying that
message's subject, delivery count and a logger bound to its event id.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from dora.bus import Bus, PublishResult
from dora.events import Event
from dora.stage.base import StageError, resolve_subject

if TYPE_CHECKING:
    from dora.stage.base import Stage


@dataclass
class StageStats:
    """Counters of one stage (all replicas), read by progress displays and summaries."""

    received: int = 0
    processed: int = 0
    published: int = 0
    duplicates: int = 0
    retried: int = 0
    dead_lettered: int = 0
    in_flight: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class Hold:
    """A message the handler keeps unsettled after it returns (e.g. a learner's batch).

    The message keeps its concurrency slot and its ack timer is kept alive until the stage
    calls ``ack()`` (done), ``nak()`` (deliver again) or ``reject(reason)`` (dead letter).
    A stage that holds up to B messages needs ``concurrency >= B``.
    """

    def __init__(self) -> None:
        self.outcome: asyncio.Future[tuple[str, str]] = asyncio.get_running_loop().create_future()

    def _settle(self, verdict: str, reason: str = "") -> None:
        if not self.outcome.done():
            self.outcome.set_result((verdict, reason))

    def ack(self) -> None:
        self._settle("ack")

    def nak(self) -> None:
        self._settle("nak")

    def reject(self, reason: str) -> None:
        self._settle("reject", reason)


@dataclass
class Context:
    """Handed to ``setup``, ``handle``, ``produce`` and ``teardown``."""

    stage: Stage
    bus: Bus
    stats: StageStats = field(default_factory=StageStats)
    completed: asyncio.Event = field(default_factory=asyncio.Event)
    subject: str = ""
    deliveries: int = 0
    event_id: str = ""
    log: Any = None
    held: Hold | None = None
    run_dir: Path | None = None
    """Where the run keeps its files (set by the pipeline; None for a bare runner)."""

    def __post_init__(self) -> None:
        if self.log is None:
            self.log = structlog.get_logger("dora.stage").bind(
                run=self.run_id, stage=self.stage.name
            )

    @property
    def run_id(self) -> str:
        return self.bus.subjects.run

    @property
    def config(self) -> Any:
        return self.stage.config

    def for_message(self, subject: str, deliveries: int, event_id: str) -> Context:
        """The per-message view (shares stats and the completion flag)."""
        log = self.log.bind(subject=subject, event_id=event_id, deliveries=deliveries)
        return dataclasses.replace(
            self, subject=subject, deliveries=deliveries, event_id=event_id, log=log, held=None
        )

    def subject_for(self, event: Event, to: str | None = None) -> str:
        """The subject an event goes to: ``to`` if given, else the one declared in ``emits``."""
        if to is not None:
            return resolve_subject(self.bus.subjects, to)
        for model, ref in self.stage.emits.items():
            if isinstance(event, model):
                return resolve_subject(self.bus.subjects, ref)
        declared = ", ".join(m.__name__ for m in self.stage.emits) or "nothing"
        raise StageError(
            f"stage {self.stage.name} emitted a {type(event).__name__} but declares {declared}; "
            "add it to `emits` or pass `to=`"
        )

    async def publish(self, event: Event, to: str | None = None) -> PublishResult | None:
        """Publish now (deduplicated by ``event.event_id``); raises when the bus fails."""
        if not isinstance(event, Event):
            raise StageError(
                f"stage {self.stage.name} published {type(event).__name__}, not an Event"
            )
        result = await self.bus.publish_event(self.subject_for(event, to), event)
        if result is not None and result.duplicate:
            self.stats.duplicates += 1
        else:
            self.stats.published += 1
        return result

    def hold(self) -> Hold:
        """Keep the current message unacked after the handler returns; settle it later."""
        if not self.event_id:
            raise StageError("ctx.hold() is only possible while handling a message")
        if self.held is None:
            self.held = Hold()
        return self.held

    def complete(self) -> None:
        """This stage is done (a sink that has seen everything); ends a pipeline run."""
        self.completed.set()

    @property
    def is_complete(self) -> bool:
        return self.completed.is_set()
