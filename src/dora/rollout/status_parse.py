"""Reading an ``EngineStatus`` off the live ``status`` subject, dead-lettering what is not one.

Several services watch ``status`` (the dispatcher, the recorder, and the orchestrator or the
baseline controller); exactly one of them, the one that acts on the fleet, dead-letters a bad
message, so each bad message leaves one dead letter.
"""

from __future__ import annotations

import structlog

from dora.bus import Bus, Message
from dora.events import EngineStatus
from dora.stage.deadletter import build_dead_letter, parse_event

log = structlog.get_logger(__name__)


async def parse_status(bus: Bus, msg: Message, stage: str) -> EngineStatus | None:
    """The status in ``msg``, or None after dead-lettering it with the reason."""
    status, reason = parse_event(EngineStatus, msg.data)
    if status is not None:
        return status
    log.warning("status_rejected", stage=stage, reason=reason[:300])
    letter = await build_dead_letter(bus, msg, stage, reason)
    await bus.publish_event(bus.subjects.deadletter, letter)
    return None
