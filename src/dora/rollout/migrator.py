"""The migrator: moves running requests between two engines of the same version, with their KV.

Protocol, per request (every step is a request-reply on ``control.<engine>``):

1. source ``export``: it stops decoding the request, writes the snapshot (tokens, logprobs,
   sampling state, KV blocks) to the object store and hands over the request's lease (the ack
   token of its queue message). Its blocks stay allocated.
2. target ``import``: it reads the blob and continues decoding with no prefill; from now on
   it heartbeats and eventually acks the lease.
3. source ``release``: only after the target confirmed, the source frees its copy.

Any failure before the target confirmed sends ``restore`` to the source, which resumes the
request intact. If the source is gone too, nothing more is needed: the lease it held expires
and the queue redelivers the request under its own version. So a request is never lost, and a
regenerated duplicate is dropped by trajectory-id dedupe. Every attempt is published as a
``MigrationRecord``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import structlog

from dora.bus import Bus, BusError
from dora.crashpoints import crash_point
from dora.events import (
    ControlReply,
    Event,
    ExportRequest,
    ImportRequest,
    Migrate,
    MigrationRecord,
    ReleaseExported,
    RestoreExported,
)
from dora.rollout.control_client import ControlClient, ControlFailed

log = structlog.get_logger(__name__)


class MigrationFailed(Exception):
    """A step of the protocol was refused or timed out."""


@dataclass(frozen=True)
class MigrationOutcome:
    """What happened to one request."""

    request_id: str
    ok: bool
    reason: str = ""
    kv_bytes: int = 0
    seconds: float = 0.0


class Migrator:
    """Executes ``Migrate`` actions over the bus."""

    def __init__(
        self, bus: Bus, timeout_s: float = 30.0, control: ControlClient | None = None
    ) -> None:
        self.bus = bus
        self.control = control or ControlClient(bus, timeout_s)
        self.outcomes: list[MigrationOutcome] = []

    async def _command(self, engine: str, command: Event) -> ControlReply:
        try:
            return await self.control.send(engine, command)
        except ControlFailed as exc:
            raise MigrationFailed(str(exc)) from exc

    async def execute(self, action: Migrate) -> list[MigrationOutcome]:
        """Migrate every request of ``action``; one outcome each."""
        outcomes = [await self.migrate_one(action, rid) for rid in action.request_ids]
        self.outcomes.extend(outcomes)
        return outcomes

    async def migrate_one(self, action: Migrate, request_id: str) -> MigrationOutcome:
        started = time.monotonic()
        blob_name = f"kv-{request_id}-{uuid.uuid4().hex[:8]}"
        try:
            exported = await self._command(
                action.source,
                ExportRequest(engine_id=action.source, request_id=request_id, blob_name=blob_name),
            )
        except MigrationFailed as exc:
            return await self._record(action, request_id, False, f"export: {exc}", started)
        if exported.blob is None:
            await self._restore(action, request_id)
            return await self._record(action, request_id, False, "export: no blob", started)
        crash_point("orchestrator.after_export")
        try:
            await self._command(
                action.target,
                ImportRequest(
                    engine_id=action.target,
                    request_id=request_id,
                    blob=exported.blob,
                    lease=exported.lease,
                    source=action.source,
                ),
            )
        except MigrationFailed as exc:
            await self._restore(action, request_id)
            await self._delete_blob(blob_name)
            return await self._record(action, request_id, False, f"import: {exc}", started)
        try:
            await self._command(
                action.source, ReleaseExported(engine_id=action.source, request_id=request_id)
            )
        except MigrationFailed as exc:  # the target owns it now; the source copy leaks only
            log.warning("release_failed", request=request_id, error=str(exc))
        await self._delete_blob(blob_name)
        return await self._record(action, request_id, True, "", started, kv_bytes=exported.kv_bytes)

    async def _restore(self, action: Migrate, request_id: str) -> None:
        try:
            await self._command(
                action.source, RestoreExported(engine_id=action.source, request_id=request_id)
            )
        except MigrationFailed as exc:
            # Source gone: its lease expires and the queue redelivers the request.
            log.warning("restore_failed_redelivery_pending", request=request_id, error=str(exc))

    async def _delete_blob(self, name: str) -> None:
        try:
            await self.bus.delete_blob(name)
        except BusError as exc:
            log.warning("blob_delete_failed", blob=name, error=str(exc))

    async def _record(
        self,
        action: Migrate,
        request_id: str,
        ok: bool,
        reason: str,
        started: float,
        kv_bytes: int = 0,
    ) -> MigrationOutcome:
        seconds = time.monotonic() - started
        record = MigrationRecord(
            request_id=request_id,
            source=action.source,
            target=action.target,
            version=action.version,
            ok=ok,
            reason=reason,
            kv_bytes=kv_bytes,
            seconds=seconds,
        )
        await self.bus.publish_event(self.bus.subjects.migrations, record)
        log.info(
            "migration",
            request=request_id,
            source=action.source,
            target=action.target,
            ok=ok,
            reason=reason,
            seconds=round(seconds, 4),
        )
        return MigrationOutcome(request_id, ok, reason, kv_bytes, seconds)
