"""Engines: the protocol (``base``), the built-in torch engine (``torch``), snapshot bytes.

``dora.engines.torch`` imports torch, so it is not imported here: ``import dora.engines``
stays light for stages that only need the protocol and its errors.
"""

from dora.engines.base import (
    CapacityError,
    Engine,
    EngineError,
    PartialOutput,
    SnapshotError,
    VersionMismatch,
)

__all__ = [
    "CapacityError",
    "Engine",
    "EngineError",
    "PartialOutput",
    "SnapshotError",
    "VersionMismatch",
]
