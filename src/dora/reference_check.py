"""What a schema cannot say about an event: that it names a version nobody published, or
that it is a second event for one request.

The recorder asks it before writing an event to the run's record, so a forged message that
validates (a trajectory "of version 999", a copy of a scored sample under a new event id)
is refused with the reason instead of sitting in ``events/`` beside the real ones. Versions
are checked against the KV record the learner writes before announcing one
(``dora.versions``); a run that never published a version (an echo pipeline) has nothing to
check against, so there every version passes.
"""

from __future__ import annotations

from collections import OrderedDict

from dora.bus.base import Bus
from dora.events import (
    Event,
    Metrics,
    MigrationRecord,
    RolloutRequest,
    ScoredTrajectory,
    Trajectory,
    WeightVersion,
)
from dora.versions import LATEST_KEY, version_key

REQUEST_MEMORY = 1 << 20
"""Request ids remembered per family for the duplicate check (about 80 MB at the limit)."""


def referenced_versions(event: Event) -> set[int]:
    """Every policy version ``event`` claims exists."""
    if isinstance(event, ScoredTrajectory):
        event = event.trajectory
    if isinstance(event, Trajectory):
        return {event.version, event.request.version, *event.token_versions}
    if isinstance(event, RolloutRequest | WeightVersion | MigrationRecord):
        return {event.version}
    if isinstance(event, Metrics):
        return {event.step + 1}  # a learner step's weights are announced before its metrics
    return set()


def request_of(event: Event) -> str | None:
    """The request an event is the one result of (trajectories and scored samples)."""
    if isinstance(event, ScoredTrajectory):
        return event.trajectory.request.request_id
    if isinstance(event, Trajectory):
        return event.request.request_id
    return None


class ReferenceCheck:
    """``await refusal(family, event)``: "" when the event may be recorded, else why not."""

    def __init__(self, bus: Bus, memory: int = REQUEST_MEMORY) -> None:
        self.bus = bus
        self.memory = memory
        self.newest = -1
        self._requests: dict[str, OrderedDict[str, None]] = {}

    async def refusal(self, family: str, event: Event) -> str:
        for version in sorted(referenced_versions(event), reverse=True):
            if not await self._published(version):
                return f"unknown version: no policy version {version} was published"
        request = request_of(event)
        if request is None:
            return ""
        seen = self._requests.setdefault(family, OrderedDict())
        if request in seen:
            return f"duplicate: {family} already holds a result of request {request!r}"
        seen[request] = None
        if len(seen) > self.memory:
            seen.popitem(last=False)
        return ""

    async def _published(self, version: int) -> bool:
        if version <= self.newest:
            return True
        if await self.bus.kv_get(version_key(version)) is not None:
            self.newest = version  # versions are published in order
            return True
        return await self.bus.kv_get(LATEST_KEY) is None  # a run without versions
