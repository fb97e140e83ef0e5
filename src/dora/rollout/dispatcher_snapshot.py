"""What the dispatcher must remember across a crash, as one JSON document in the KV store.

The dispatcher's observations (``scored``, ``metrics``, ``weights``, ``prompts``) are acked
only after the snapshot that contains their effect is written, so a restarted dispatcher
resumes from the snapshot and the bus redelivers exactly what came after it; every
observation is idempotent, so one applied twice (written, then crashed before the ack) is
harmless. Groups are stored by id, size and the indices of their finished samples (request
ids are ``<group id>/<index>``), so the document stays small: open groups, per-version
counts and a bounded list of recently consumed groups.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from dora.events import RolloutRequest
from dora.subjects import DISPATCHER_KEY as SNAPSHOT_KEY


class OpenGroup(BaseModel):
    """A dispatched group the learner has not consumed yet."""

    model_config = ConfigDict(extra="forbid")

    group_id: str
    version: int
    size: int
    done: list[int] = Field(default_factory=list)
    """Indices of its samples already scored."""


class DispatcherSnapshot(BaseModel):
    """The dispatcher core's state (``Dispatcher.snapshot`` / ``Dispatcher.restore``)."""

    model_config = ConfigDict(extra="forbid")

    mode: str
    group_size: int
    newest_version: int = 0
    learner_step: int = 0
    counts: dict[int, tuple[int, ...]] = Field(default_factory=dict)
    """Per version: groups dispatched, finished, consumed and abandoned (snapshots written
    before abandonment existed have the first three)."""
    groups: list[OpenGroup] = Field(default_factory=list)
    consumed: list[str] = Field(default_factory=list)
    """Recently consumed group ids, oldest first (late ``scored`` samples of them are no-ops)."""
    abandoned: list[str] = Field(default_factory=list)
    """Recently abandoned group ids, oldest first (also in ``consumed``: settled)."""
    repeats: dict[str, int] = Field(default_factory=dict)
    """Prompt ids admitted more than once, with their count (unique ids are the rule)."""
    last_prompt: str | None = None
    """Event id of the last prompt admitted: redelivered after a crash, it is not admitted
    twice."""
    unpublished: list[RolloutRequest] = Field(default_factory=list)
    """Requests of the last admitted group not yet known to be published: republished on
    restore under the same event ids (the requests stream drops the duplicates)."""


__all__ = ["SNAPSHOT_KEY", "DispatcherSnapshot", "OpenGroup"]
