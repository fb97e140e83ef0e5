"""Configuration of the learner service (one dataclass, nested loss and optimiser configs)."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dora.learner.broadcast import BroadcastConfig
from dora.learner.grpo import GRPOConfig
from dora.learner.trainer import OptimConfig


@dataclass(frozen=True)
class LearnerConfig:
    """Everything the learner service needs besides the bus, the model and the run dir."""

    batch_groups: int = 8
    """B: GRPO groups per learner step."""
    staleness_bound: int = 2
    """K: a group of version u may be trained at step s only if s - u <= K."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    max_steps: int | None = None
    """Stop after this many steps (None: run until stopped)."""
    checkpoint_every: int = 10
    """Steps between checkpoints (messages stay unacked until one covers them)."""
    keep_checkpoints: int | None = 3
    publish_initial: bool = True
    """On a fresh start, publish the initial weights as version 0."""
    weight_store: Literal["objectstore", "directory", "broadcast"] = "objectstore"
    """How weights reach the engines: the NATS object store, a shared directory, or a
    collective broadcast from the learner to the engines loading each version
    (``dora.learner.broadcast``; held in the learner's memory, so not across its restart)."""
    weight_broadcast: BroadcastConfig = field(default_factory=BroadcastConfig)
    """``weight_store: broadcast``: where its rendezvous listens, bucket size, timeouts."""
    weight_dir: Path | None = None
    """Directory of the ``directory`` weight store (default: ``<run_dir>/weights``)."""
    keep_weight_versions: int | Literal["all"] | None = None
    """Delete weight blobs older than the newest N versions. None (default): K + 2, every
    version a request may still be generated with (K) plus the one being loaded and one of
    slack; "all" keeps every version (the run's store then grows by a model per step)."""
    durable: str = "learner"
    fetch_batch: int = 64
    fetch_timeout_s: float = 0.5
    ack_wait_s: float = 60.0
    max_ack_pending: int | None = None
    """Default: room for ``checkpoint_every + 2`` batches of groups of 16, at least 1024."""
    ledger_poll_s: float = 0.2
    max_urgent_wait_s: float | None = None
    """Stop waiting for an urgent group after this long (None: wait forever; a group lost
    upstream then stalls the learner, which is logged while it waits)."""
    tensorboard: bool = True

    def __post_init__(self) -> None:
        if self.batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1, got {self.batch_groups}")
        if self.staleness_bound < 0:
            raise ValueError(f"staleness_bound must be >= 0, got {self.staleness_bound}")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, got {self.max_steps}")
        kept = self.keep_weight_versions
        if kept is not None and kept != "all" and (not isinstance(kept, int) or kept < 1):
            raise ValueError(f"keep_weight_versions must be >= 1, 'all' or null, got {kept!r}")
        if self.ack_wait_s <= 0:
            raise ValueError(f"ack_wait_s must be > 0, got {self.ack_wait_s}")

    @property
    def weight_versions_kept(self) -> int | None:
        """How many newest weight versions the store keeps (None: all)."""
        if self.keep_weight_versions == "all":
            return None
        if self.keep_weight_versions is None:
            return self.staleness_bound + 2
        return self.keep_weight_versions

    @property
    def ack_pending_limit(self) -> int:
        if self.max_ack_pending is not None:
            return self.max_ack_pending
        return max(1024, (self.checkpoint_every + 2) * self.batch_groups * 16)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LearnerConfig:
        """Build from plain data (YAML/JSON): ``grpo`` and ``optim`` may be nested dicts.

        Unknown keys raise ``ValueError`` naming them.
        """
        data = dict(data)
        for name, sub in (("grpo", GRPOConfig), ("optim", OptimConfig)):
            value = data.get(name)
            if isinstance(value, dict):
                data[name] = build_dataclass(sub, value, f"learner.{name}")
        if isinstance(data.get("weight_broadcast"), dict):
            data["weight_broadcast"] = BroadcastConfig.model_validate(data["weight_broadcast"])
        if isinstance(data.get("weight_dir"), str):
            data["weight_dir"] = Path(data["weight_dir"])
        return build_dataclass(cls, data, "learner")


def build_dataclass(cls: Any, data: dict[str, Any], where: str) -> Any:
    """``cls(**data)`` for a config dataclass, refusing unknown fields by name (``where``)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: {unknown_fields_message(unknown, names)}")
    if "betas" in data:
        data = {**data, "betas": tuple(data["betas"])}
    return cls(**data)


def unknown_fields_message(unknown: list[str], known: set[str]) -> str:
    """``unknown field 'max_step' (did you mean 'max_steps'?)``, or the known names when
    nothing is close: short enough to read in one or two lines."""
    close = {name: difflib.get_close_matches(name, known, n=1) for name in unknown}
    parts = [f"{n!r} (did you mean {c[0]!r}?)" if c else repr(n) for n, c in close.items()]
    message = f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(parts)}"
    if not all(close.values()):
        message += f"; known: {', '.join(sorted(known))}"
    return message
