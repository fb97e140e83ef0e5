"""The generator's side of a KV migration: export, import, release, restore.

The migrator drives the protocol by control commands; this module does what each step means
for one engine. The request's queue lease travels with it (``ControlReply.lease``), so the
engine that finishes it acks it. An export the migrator abandons is restored here after
``export_timeout_s``, or the request and its KV would stay parked forever.
"""

from __future__ import annotations

import time

from dora.engines.base import EngineError
from dora.events import ControlReply, ExportRequest, ImportRequest
from dora.rollout.generator_base import GeneratorBase, Held


class MigrationSide(GeneratorBase):
    """Export / import handlers of ``Generator`` (see module docstring)."""

    async def _export(self, command: ExportRequest) -> ControlReply:
        held = self._held.get(command.request_id)
        if held is None:  # the orchestrator planned on a snapshot taken before it finished
            raise EngineError(
                f"request {command.request_id!r} is no longer on {self.config.engine_id} "
                "(finished before the export; nothing to move)"
            )
        snapshot = await self._call(self.engine.export_request, command.request_id)
        held.exported = True
        held.exported_at = time.monotonic()
        try:
            blob = await self.bus.put_blob(command.blob_name, snapshot)
        except Exception:
            await self._call(self.engine.restore_exported, command.request_id)
            held.exported = False
            raise
        return ControlReply(ok=True, blob=blob, lease=held.lease.ack_token, kv_bytes=len(snapshot))

    async def _import(self, command: ImportRequest) -> ControlReply:
        if self.draining or self.assigned != self.engine.version:
            raise EngineError(f"engine {self.config.engine_id} is not serving; cannot import")
        data = await self.bus.get_blob(command.blob.name)
        request_id = await self._call(self.engine.import_request, data)
        self._held[request_id] = Held(self.bus.lease(command.lease))
        self.stats.imported += 1
        return ControlReply(ok=True, kv_bytes=len(data))

    async def _release_exported(self, rid: str) -> ControlReply:
        """The target imported it: forget it here (its lease now lives there)."""
        self._held.pop(rid)  # KeyError (an error reply) when it is not held here
        await self._call(self.engine.release_exported, rid)
        self.stats.exported += 1
        return ControlReply(ok=True)

    async def _restore_exported(self, rid: str) -> ControlReply:
        """The migration failed: the request goes on generating here."""
        await self._call(self.engine.restore_exported, rid)
        self._held[rid].exported = False
        self.stats.restored += 1
        return ControlReply(ok=True)

    async def _reclaim_stale_exports(self) -> None:
        deadline = time.monotonic() - self.config.export_timeout_s
        for rid, held in list(self._held.items()):
            if held.exported and held.exported_at < deadline:
                try:
                    await self._call(self.engine.restore_exported, rid)
                except (EngineError, KeyError):  # released or restored meanwhile
                    continue
                held.exported = False
                self.stats.restored += 1
                self._log.warning("stale_export_restored", request=rid)
                self._wake.set()
