"""Which policy versions exist: the KV record written before a version is announced.

The learner records every ``WeightVersion`` in the KV store (``weights.v<N>``, and
``weights.latest``) before it publishes the event on ``subjects.weights``, so a late engine
can find any version and an observer can tell a real announcement from a message that names
a version nobody published (a forged or corrupted event that would otherwise make the
dispatcher believe the learner is hundreds of steps ahead and refuse every group as stale).
"""

from __future__ import annotations

from dora.bus.base import Bus
from dora.events import WeightVersion
from dora.subjects import WEIGHTS_LATEST_KEY as LATEST_KEY
from dora.subjects import weights_version_key as version_key


class UnknownVersion(ValueError):
    """An event names a policy version that was never published."""


async def announce(bus: Bus, event: WeightVersion) -> None:
    """Record ``event`` in the KV store, then publish it (the order observers rely on)."""
    payload = event.model_dump_json().encode()
    await bus.kv_put(version_key(event.version), payload)
    await bus.kv_put(LATEST_KEY, payload)
    await bus.publish_event(bus.subjects.weights, event)


async def check_published(bus: Bus, version: int, what: str, checksum: str | None = None) -> None:
    """Raise ``UnknownVersion`` unless ``version`` has a KV record (``what`` names the
    reference, e.g. ``"WeightVersion.version"``) whose checksum is ``checksum`` when given.
    Observers call it only for versions newer than the newest they know, so the common case
    costs no lookup."""
    raw = await bus.kv_get(version_key(version))
    if raw is None:
        raise UnknownVersion(f"{what} {version}: no policy version {version} was published")
    if checksum is not None:
        recorded = WeightVersion.model_validate_json(raw).checksum
        if recorded != checksum:
            raise UnknownVersion(
                f"{what} {version}: checksum {checksum[:16]!r} is not the published "
                f"{recorded[:16]!r}"
            )
