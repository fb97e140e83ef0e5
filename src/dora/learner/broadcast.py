"""Weights by collective broadcast (``weight_store: broadcast``): from the learner to exactly
the engines loading a version, over torch.distributed's gloo backend (host memory; an NCCL
path for GPU-resident weights is not built yet).

The learner keeps the newest versions' bytes in memory and a rendezvous on a ``TCPStore``
(``BroadcastServer``, a thread of its own, so training never waits on it). An engine that
loads a version takes a ticket for it; the server gathers the tickets waiting for that
version into one wave, tells each its rank, and broadcasts the bytes in buckets over a
process group made for that wave alone (``ProcessGroupGloo`` on a prefix of the store: no
global ``torch.distributed`` state, so waves of any size and members come and go). The
engine checks the version's checksum as for any transport (``WeightFetcher``). The
``WeightVersion`` event stays the control message; its blob says ``store: broadcast`` and
``name: HOST:PORT/<blob>``. What is not there: a version the server no longer holds
(pruned, or a learner restarted since) is a ``WeightError`` at once, not a fallback.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
from dataclasses import dataclass

import structlog
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

from dora.events import BlobRef
from dora.learner.weights import WeightError, sha256

log = structlog.get_logger(__name__)

GONE = "gone"


class BroadcastConfig(BaseModel):
    """Where the learner's broadcast rendezvous listens, and how it sends."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(default="127.0.0.1", description="An address every engine reaches.")
    port: int = Field(default=0, ge=0, le=65535, description="0: any free port.")
    bucket_mb: float = Field(default=64.0, gt=0, description="Bytes per broadcast call.")
    gather_s: float = Field(
        default=0.05, ge=0, description="After a first ticket, wait this long for others."
    )
    timeout_s: float = Field(default=60.0, gt=0)


def _group(
    store: TCPStore, prefix: str, rank: int, size: int, host: str, timeout: float
) -> ProcessGroupGloo:
    options = ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout)
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    return ProcessGroupGloo(PrefixStore(prefix, store), rank, size, options)


@dataclass
class Wave:
    """One broadcast: a blob to ``receivers`` engines at once."""

    name: str
    receivers: int
    seconds: float


class BroadcastServer:
    """The learner's side: holds blobs, answers tickets with waves, broadcasts."""

    def __init__(self, config: BroadcastConfig | None = None) -> None:
        self.config = config or BroadcastConfig()
        timeout = datetime.timedelta(seconds=self.config.timeout_s)
        self.store = TCPStore(
            self.config.host, self.config.port, None, True, timeout, wait_for_workers=False
        )
        self.address = f"{self.config.host}:{self.store.port}"
        self.waves: list[Wave] = []
        self._blobs: dict[str, torch.Tensor] = {}
        self._retired: set[str] = set()
        self._served: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="weight-broadcast", daemon=True)
        self._thread.start()

    def offer(self, name: str, data: bytes) -> BlobRef:
        """Hold ``data`` for engines to fetch as ``name``; its BlobRef for the event."""
        with self._lock:
            self._blobs[name] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self._served.setdefault(name, 0)
        self.store.set(f"offered/{name}", str(len(data)))
        return BlobRef(
            store="broadcast", name=f"{self.address}/{name}", size=len(data), sha256=sha256(data)
        )

    def retire(self, name: str) -> None:
        """Stop holding ``name``: waiting and later tickets are told it is gone."""
        with self._lock:
            self._blobs.pop(name, None)
            self._retired.add(name)
        self.store.delete_key(f"offered/{name}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.config.timeout_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = False
            with self._lock:
                names = [*self._blobs, *self._retired]
            for name in names:
                waiting = self.store.add(f"{name}/tickets", 0)
                if waiting > self._served.get(name, 0):
                    busy = True
                    try:
                        self._serve(name)
                    except Exception as exc:  # a receiver died mid-wave: it retries
                        log.warning("weight_broadcast_failed", blob=name, error=str(exc))
            if not busy:
                time.sleep(0.002)

    def _serve(self, name: str) -> None:
        if self.config.gather_s:
            time.sleep(self.config.gather_s)  # engines loading the same version: one wave
        first = self._served.get(name, 0)
        last = self.store.add(f"{name}/tickets", 0)
        self._served[name] = last
        with self._lock:
            blob = self._blobs.get(name)
        if blob is None:
            for ticket in range(first + 1, last + 1):
                self.store.set(f"{name}/t{ticket}", GONE)
            return
        size = last - first + 1
        prefix = f"{name}/w{first}"
        bucket = max(1, int(self.config.bucket_mb * 2**20))
        for ticket in range(first + 1, last + 1):
            self.store.set(f"{name}/t{ticket}", f"{prefix} {ticket - first} {size} {bucket}")
        t0 = time.perf_counter()
        group = _group(self.store, prefix, 0, size, self.config.host, self.config.timeout_s)
        for start in range(0, blob.numel(), bucket):
            group.broadcast([blob[start : start + bucket]]).wait()
        seconds = time.perf_counter() - t0
        self.waves.append(Wave(name, size - 1, seconds))
        log.info("weights_broadcast", blob=name, engines=size - 1, bytes=blob.numel(), s=seconds)


def receive(ref: BlobRef, timeout_s: float = 60.0) -> bytes:
    """The engine's side (blocking): a ticket, a rank in the next wave, the bytes."""
    address, _, name = ref.name.partition("/")
    host, _, port = address.rpartition(":")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = TCPStore(host, int(port), None, False, timeout)
    except Exception as exc:  # (RuntimeError / DistNetworkError) no server there any more
        raise WeightError(f"weights {name}: no broadcast server at {address}: {exc}") from exc
    if not store.check([f"offered/{name}"]):
        raise WeightError(f"weights {name}: not held by the broadcast server at {address}")
    ticket = store.add(f"{name}/tickets", 1)
    key = f"{name}/t{ticket}"
    store.wait([key], timeout)
    answer = store.get(key).decode()
    if answer == GONE:
        raise WeightError(f"weights {name}: retired by the broadcast server at {address}")
    prefix, rank, size, bucket = answer.split()
    group = _group(store, prefix, int(rank), int(size), host, timeout_s)
    buffer = torch.empty(ref.size, dtype=torch.uint8)
    for start in range(0, ref.size, int(bucket)):
        group.broadcast([buffer[start : start + int(bucket)]]).wait()
    return buffer.numpy().tobytes()


class BroadcastTransport:
    """``WeightTransport`` for ``store: broadcast``: ``put`` offers the blob on the learner's
    server (None on an engine, which only reads), ``get`` receives it in a wave."""

    store = "broadcast"

    def __init__(self, server: BroadcastServer | None = None, timeout_s: float = 60.0) -> None:
        self.server = server
        self.timeout_s = timeout_s

    async def put(self, name: str, data: bytes) -> BlobRef:
        if self.server is None:
            raise WeightError("only the learner's transport (with a server) can put weights")
        return await asyncio.to_thread(self.server.offer, name, data)

    async def get(self, ref: BlobRef) -> bytes:
        return await asyncio.to_thread(receive, ref, self.timeout_s)

    async def delete(self, ref: BlobRef) -> None:
        if self.server is not None:
            self.server.retire(ref.name.partition("/")[2])

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
