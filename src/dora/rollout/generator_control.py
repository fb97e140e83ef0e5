"""Control commands: what the orchestrator and the migrator may ask of one generator.

Commands arrive by request-reply on ``control.<engine>`` (assign, drain, prioritize, and the
migrator's export / import / release / restore). Every command gets a ``ControlReply``; a bad
or failing one gets ``ok=False`` with the reason and never kills the engine loop. Under the
``partial`` baseline, a reassignment also interrupts in-flight requests so they resume under
the new weights (``dora.rollout.partial``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from pydantic import TypeAdapter, ValidationError

from dora.engines.base import EngineError
from dora.events import (
    AssignVersion,
    ControlCommand,
    ControlReply,
    Drain,
    ExportRequest,
    ImportRequest,
    Prioritize,
    ReleaseExported,
    RestoreExported,
)
from dora.rollout.generator_migration import MigrationSide
from dora.rollout.partial import resumed

_COMMANDS: TypeAdapter[Any] = TypeAdapter(ControlCommand)


class ControlHandler(MigrationSide):
    """The ``control.<engine>`` handler of ``Generator`` (see module docstring)."""

    async def _control(self, data: bytes) -> bytes:
        try:
            command = _COMMANDS.validate_json(data)
            reply = await self._apply(command)
        except (ValidationError, EngineError, KeyError) as exc:
            reply = ControlReply(ok=False, error=f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a command must never kill the engine loop
            self._log.exception("control_failed")
            reply = ControlReply(ok=False, error=f"{type(exc).__name__}: {exc}")
        self._wake.set()
        self._room.set()
        return reply.model_dump_json().encode()

    async def _apply(self, command: Any) -> ControlReply:
        match command:
            case AssignVersion(version=version):
                return await self._assign(version)
            case Drain():
                self.draining = True
                self.state = "draining"
                return ControlReply(ok=True)
            case Prioritize(request_ids=ids, priority=priority):
                for rid in ids:
                    if rid in self._held and not self._held[rid].exported:
                        with contextlib.suppress(EngineError):  # it may just have finished
                            await self._call(self.engine.set_priority, rid, priority)
                return ControlReply(ok=True)
            case ExportRequest():
                return await self._export(command)
            case ImportRequest():
                return await self._import(command)
            case ReleaseExported(request_id=rid):
                return await self._release_exported(rid)
            case RestoreExported(request_id=rid):
                return await self._restore_exported(rid)
        return ControlReply(ok=False, error=f"unsupported command {type(command).__name__}")

    async def _assign(self, version: int) -> ControlReply:
        previous = self.assigned
        self.assigned = version
        self.draining = False
        if self.engine.version == version:
            self.state = "serving"
        if self.config.mode == "partial" and previous is not None and previous != version:
            self._backlog.add(previous)
            await self._interrupt_partial(version)
        self._log.info("assigned", version=version, previous=previous)
        return ControlReply(ok=True)

    async def _interrupt_partial(self, version: int) -> None:
        """Partial rollout: abort in-flight work; it is re-added first, under ``version`` with
        its tokens, right after the load (``dora.rollout.partial``). Leases stay held."""
        loaded = self.engine.version
        pending = {r.request_id for r in self._resumes}
        rids = [rid for rid, h in self._held.items() if not h.exported and rid not in pending]
        for part in await self._call(self._abort_all, rids):
            self._resumes.append(resumed(part, loaded, version))
            self.stats.resubmitted += 1

    def _abort_all(self, rids: list[str]) -> list[Any]:
        """Engine thread: abort ``rids`` in one job (one hop for the whole engine); a request
        that finished meanwhile is skipped (its trajectory is on its way)."""
        parts = []
        for rid in rids:
            with contextlib.suppress(EngineError):
                parts.append(self.engine.abort(rid))
        return parts
