"""The one way to command an engine: a typed request on ``control.<engine>`` whose reply is
always read and checked.

The orchestrator, the migrator and the baseline controller all drive generators this way, so
none of them can record an effect the engine refused (a refused assignment, a failed export)
or mistake a malformed reply for success.
"""

from __future__ import annotations

from dora.bus import Bus
from dora.events import ControlReply, Event
from dora.stage.deadletter import parse_event


class ControlFailed(Exception):
    """The engine refused the command, did not answer, or answered something unreadable."""

    def __init__(self, engine_id: str, reason: str) -> None:
        super().__init__(f"{engine_id}: {reason}")
        self.engine_id = engine_id
        self.reason = reason


class ControlClient:
    """``await send(engine, command)`` -> the engine's ``ControlReply`` (always ``ok``)."""

    def __init__(self, bus: Bus, timeout_s: float = 30.0) -> None:
        self.bus = bus
        self.timeout_s = timeout_s

    async def send(self, engine_id: str, command: Event) -> ControlReply:
        """Raise ``ControlFailed`` unless the engine accepted ``command``."""
        try:
            raw = await self.bus.request(
                self.bus.subjects.control(engine_id),
                command.model_dump_json().encode(),
                timeout=self.timeout_s,
            )
        except Exception as exc:  # no responder, a timeout, the connection away: all "failed"
            raise ControlFailed(engine_id, f"{type(exc).__name__}: {exc}") from exc
        reply, reason = parse_event(ControlReply, raw)
        if reply is None:
            raise ControlFailed(engine_id, f"unreadable reply: {reason}")
        if not reply.ok:
            raise ControlFailed(engine_id, f"refused: {reply.error}")
        return reply
