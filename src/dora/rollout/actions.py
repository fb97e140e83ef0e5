"""What ``plan`` may decide: four actions, each mapping to one ``dora.events`` control command.

Actions are plain frozen dataclasses (cheap to build by the thousand in the simulator);
``to_command()`` turns one into the wire command the service sends on ``control.<engine>``
(``MigrateRequests`` goes to the migrator, which runs the export/import/release protocol).
"""

from __future__ import annotations

from dataclasses import dataclass

from dora import events


@dataclass(frozen=True, slots=True)
class AssignEngine:
    """Serve ``version``: stop pulling any other version, finish the loaded version's running
    requests, load ``version`` when empty (no load if already loaded), then pull its queue.
    Also un-drains a draining engine."""

    engine_id: str
    version: int
    reason: str = ""

    def to_command(self) -> events.AssignVersion:
        return events.AssignVersion(engine_id=self.engine_id, version=self.version)


@dataclass(frozen=True, slots=True)
class DrainEngine:
    """Stop pulling new requests; running ones finish (or are migrated away)."""

    engine_id: str
    reason: str = ""

    def to_command(self) -> events.Drain:
        return events.Drain(engine_id=self.engine_id)


@dataclass(frozen=True, slots=True)
class MigrateRequests:
    """Move running requests ``source -> target`` with their KV (same ``version``)."""

    source: str
    target: str
    version: int
    request_ids: tuple[str, ...]
    kv_blocks: int = 0
    """Blocks moved (for accounting; the target had room for them plus growth headroom)."""
    reason: str = ""

    def to_command(self) -> events.Migrate:
        return events.Migrate(
            source=self.source,
            target=self.target,
            version=self.version,
            request_ids=self.request_ids,
        )


@dataclass(frozen=True, slots=True)
class PrioritizeRequests:
    """Raise the priority of urgent requests on one engine (their deadline step is near)."""

    engine_id: str
    request_ids: tuple[str, ...]
    priority: int
    reason: str = ""

    def to_command(self) -> events.Prioritize:
        return events.Prioritize(
            engine_id=self.engine_id, request_ids=self.request_ids, priority=self.priority
        )


Action = AssignEngine | DrainEngine | MigrateRequests | PrioritizeRequests
