"""The Engine protocol: what a generator, the migrator and the orchestrator may ask of an engine.

Engines are synchronous, single-threaded objects driven by ``step()``; the generator stage
runs them off the event loop. The built-in torch engine, the timing-model engine and the vLLM
adapter all implement this protocol, so every rollout mode runs unchanged on each of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from dora.events import EngineStatus, RolloutRequest, Trajectory


class EngineError(Exception):
    """A request, snapshot or command the engine refuses; the engine keeps serving the rest."""


class VersionMismatch(EngineError):
    """Weights or a snapshot of another version than the engine's requests allow."""


class SnapshotError(EngineError):
    """A KV snapshot that is corrupt, truncated, or made for another model, dtype or block size."""


class CapacityError(EngineError):
    """The engine has no room (KV blocks) for what it was asked to take."""


@dataclass(frozen=True)
class PartialOutput:
    """What an aborted request had generated (partial-rollout baseline resubmits it)."""

    request: RolloutRequest
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    engines: tuple[str, ...]


@dataclass(frozen=True)
class TurnEnd:
    """A multi-turn request parked at the end of an assistant turn (its KV kept), waiting for
    the environment's reply (``append``)."""

    request_id: str
    token_ids: tuple[int, ...]
    """The turn's sampled tokens."""
    text: str


@runtime_checkable
class Engine(Protocol):
    """A replica that generates completions for the one policy version it has loaded."""

    engine_id: str

    @property
    def version(self) -> int | None:
        """Version of the loaded weights, or None before the first load."""
        ...

    def add_request(self, request: RolloutRequest) -> None:
        """Queue a request of the loaded version; raise EngineError on bad input."""
        ...

    def step(self) -> list[Trajectory]:
        """Advance by one scheduler step; return the trajectories that finished in it."""
        ...

    def has_work(self) -> bool:
        """True while any request is running or waiting."""
        ...

    def num_requests(self) -> int:
        """Requests held (running + waiting + exported-but-unconfirmed)."""
        ...

    def abort(self, request_id: str) -> PartialOutput:
        """Stop a request and free it, returning what it had generated."""
        ...

    def set_priority(self, request_id: str, priority: int) -> None:
        """Raise (or lower) a request's scheduling priority."""
        ...

    def load_weights(self, version: int, weights: Mapping[str, Any] | Path) -> None:
        """Swap to ``version``; raise VersionMismatch while holding requests of another."""
        ...

    def export_request(self, request_id: str) -> bytes:
        """Stop decoding a request and serialize it with its KV blocks.

        The blocks stay allocated until ``release_exported`` (target confirmed) or
        ``restore_exported`` (migration failed: the request resumes here, intact).
        """
        ...

    def release_exported(self, request_id: str) -> None:
        """Free an exported request's blocks once the target confirmed the import."""
        ...

    def restore_exported(self, request_id: str) -> None:
        """Put an exported request back into this engine's running set."""
        ...

    def import_request(self, snapshot: bytes) -> str:
        """Continue a request exported by an engine of the same version; return its id."""
        ...

    def status(self) -> EngineStatus:
        """Current load for the orchestrator."""
        ...
