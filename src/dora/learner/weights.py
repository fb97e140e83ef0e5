"""Weight publication (learner side) and fetching (engine side).

After each step the learner serialises ``hf_state_dict(model)`` to safetensors bytes, stores
them through a ``WeightTransport`` (the JetStream object store by default, or a shared
directory), records the ``WeightVersion`` event in the KV store (``weights.v<N>`` and
``weights.latest``, so a late engine can find any version) and publishes it on
``subjects.weights``. Blob names contain the checksum, so a blob is immutable: a learner that
resumes from a checkpoint and republishes a version number writes a new blob, never changes
one an engine is reading.

``WeightTransport`` is the seam for faster transports: ``dora.learner.broadcast`` sends each
version from the learner's memory to the engines loading it, over a gloo process group made
for that wave of engines.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

import structlog
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from dora.bus.base import Bus
from dora.events import BlobRef, WeightVersion
from dora.models import LlamaModel, hf_state_dict
from dora.subjects import WEIGHTS_PRUNED_KEY as PRUNED_KEY
from dora.versions import LATEST_KEY, announce, version_key

log = structlog.get_logger(__name__)

"""KV key: every version below it has had its blob deleted."""


class WeightError(Exception):
    """A weight version that cannot be found or loaded."""


class ChecksumMismatch(WeightError):
    """The fetched bytes are not the ones the WeightVersion event describes."""


def serialize_state_dict(state: dict[str, Tensor]) -> bytes:
    """Safetensors bytes of a state dict (CPU, contiguous)."""
    return st_save({k: v.detach().cpu().contiguous() for k, v in state.items()})


def deserialize_state_dict(data: bytes, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    state = st_load(data)
    return {k: v.to(device) for k, v in state.items()} if str(device) != "cpu" else state


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@runtime_checkable
class WeightTransport(Protocol):
    """Moves weight bytes from the learner to engines."""

    store: str

    async def put(self, name: str, data: bytes) -> BlobRef: ...

    async def get(self, ref: BlobRef) -> bytes: ...

    async def delete(self, ref: BlobRef) -> None: ...


class ObjectStoreTransport:
    """Weights as blobs in the bus's object store (JetStream object store on NATS)."""

    store = "objectstore"

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def put(self, name: str, data: bytes) -> BlobRef:
        return await self.bus.put_blob(name, data)

    async def get(self, ref: BlobRef) -> bytes:
        return await self.bus.get_blob(ref.name)

    async def delete(self, ref: BlobRef) -> None:
        await self.bus.delete_blob(ref.name)


class DirectoryTransport:
    """Weights as files in a directory every engine can read (NFS, local disk)."""

    store = "directory"

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory).resolve()  # the BlobRef must work from any cwd

    async def put(self, name: str, data: bytes) -> BlobRef:
        path = self.directory / f"{name}.safetensors"

        def write() -> None:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)

        await asyncio.to_thread(write)
        return BlobRef(store="directory", name=str(path), size=len(data), sha256=sha256(data))

    async def get(self, ref: BlobRef) -> bytes:
        try:
            return await asyncio.to_thread(Path(ref.name).read_bytes)
        except OSError as exc:
            raise WeightError(f"cannot read weights file {ref.name}: {exc}") from exc

    async def delete(self, ref: BlobRef) -> None:
        Path(ref.name).unlink(missing_ok=True)


class WeightPublisher:
    """Stores and announces new policy versions; keeps the last ``keep_versions`` blobs."""

    def __init__(
        self,
        bus: Bus,
        transport: WeightTransport | None = None,
        keep_versions: int | None = None,
    ) -> None:
        self.bus = bus
        self.transport = transport or ObjectStoreTransport(bus)
        self.keep_versions = keep_versions

    async def publish(
        self,
        model: LlamaModel,
        version: int,
        *,
        step: int,
        metrics: dict[str, float] | None = None,
        step_end: float | None = None,
    ) -> WeightVersion:
        """Serialise, store and announce ``model`` as ``version``.

        ``step_end`` (``time.time()`` when the step finished) lets the event carry
        ``weights/publish_s``: the time from the end of the step to the announcement.
        """
        state = {k: v.cpu() for k, v in hf_state_dict(model).items()}
        data = await asyncio.to_thread(serialize_state_dict, state)
        digest = sha256(data)
        ref = await self.transport.put(f"weights-v{version:06d}-{digest[:16]}", data)
        values = dict(metrics or {})
        values["weights/bytes"] = float(len(data))
        if step_end is not None:
            values["weights/step_end_at"] = step_end
            values["weights/publish_s"] = time.time() - step_end
        event = WeightVersion(version=version, blob=ref, checksum=digest, step=step, metrics=values)
        await announce(self.bus, event)
        log.info("weights_published", version=version, bytes=len(data), sha256=digest[:12])
        await self._prune(version)
        return event

    async def _prune(self, version: int) -> None:
        """Delete the blobs of versions older than the newest ``keep_versions``.

        Which versions are gone is kept in the KV store (``weights.pruned_below``), not in
        this process: a resumed learner also prunes what its predecessor published.
        """
        if self.keep_versions is None:
            return
        below = version - self.keep_versions + 1
        raw = await self.bus.kv_get(PRUNED_KEY)
        start = int(raw) if raw else 0
        for old in range(start, below):
            announced = await self.bus.kv_get(version_key(old))
            if announced is not None:
                await self.transport.delete(WeightVersion.model_validate_json(announced).blob)
        if below > start:
            await self.bus.kv_put(PRUNED_KEY, str(below).encode())


class WeightFetcher:
    """Engine side: fetch a version, verify its checksum, return the state dict (cached)."""

    def __init__(
        self,
        bus: Bus,
        transports: dict[str, WeightTransport] | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        self.bus = bus
        from dora.learner.broadcast import BroadcastTransport  # it builds on this module

        self.transports: dict[str, WeightTransport] = {
            "objectstore": ObjectStoreTransport(bus),
            "broadcast": BroadcastTransport(),  # receives; the address is in each BlobRef
        }
        self.transports.update(transports or {})
        self.transports.setdefault("directory", DirectoryTransport(Path(".")))
        self.device = device
        self.known: dict[int, WeightVersion] = {}
        self._cache: tuple[WeightVersion, dict[str, Tensor]] | None = None

    def remember(self, event: WeightVersion) -> None:
        """Record an event seen on ``subjects.weights`` (saves a KV lookup later)."""
        self.known[event.version] = event

    async def describe(self, version: int | None = None) -> WeightVersion:
        """The WeightVersion event of ``version`` (None: the latest published).

        The KV store is asked first: after a learner resumes from a checkpoint it republishes
        the versions past the checkpoint, and the newest announcement of a number wins.
        """
        key = LATEST_KEY if version is None else version_key(version)
        raw = await self.bus.kv_get(key)
        if raw is None:
            if version is not None and version in self.known:
                return self.known[version]
            what = "no weights published yet" if version is None else f"version {version}"
            raise WeightError(f"weights not found: {what}")
        event = WeightVersion.model_validate_json(raw)
        self.remember(event)
        return event

    async def fetch(self, version: int | WeightVersion | None = None) -> dict[str, Tensor]:
        """The state dict of a version (None: latest); raises ChecksumMismatch on bad bytes."""
        event = version if isinstance(version, WeightVersion) else await self.describe(version)
        cached = self._cache
        if cached is not None and cached[0].checksum == event.checksum:
            return cached[1]
        transport = self.transports.get(event.blob.store)
        if transport is None:
            raise WeightError(f"no transport for blob store {event.blob.store!r}")
        t0 = time.perf_counter()
        data = await transport.get(event.blob)
        digest = await asyncio.to_thread(sha256, data)
        if digest != event.checksum:
            raise ChecksumMismatch(
                f"weights v{event.version}: sha256 {digest[:16]}... != expected "
                f"{event.checksum[:16]}... ({len(data)} bytes from {event.blob.name}); not loaded"
            )
        state = await asyncio.to_thread(deserialize_state_dict, data, self.device)
        if self._cache is None or event.version >= self._cache[0].version:
            self._cache = (event, state)
        log.info("weights_fetched", version=event.version, s=round(time.perf_counter() - t0, 3))
        return state

    @property
    def latest(self) -> WeightVersion | None:
        """The newest version fetched so far (its state dict is cached)."""
        return None if self._cache is None else self._cache[0]
