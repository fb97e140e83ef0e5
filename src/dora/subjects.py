"""Subject names: the one place that spells them.

Every subject is prefixed by the run id, so several runs can share one NATS server. Durable
streams (JetStream) are named after the subject family they capture.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def episode_token(episode_id: str) -> str:
    """A NATS token naming an episode: its id when it is one, else a digest of it (request
    ids such as ``g-1f2e/3`` hold a slash)."""
    if _TOKEN.match(episode_id) and len(episode_id) <= 64:
        return episode_id
    return "e" + hashlib.blake2b(episode_id.encode(), digest_size=12).hexdigest()


def _check_token(value: str, what: str) -> str:
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} must match [A-Za-z0-9_-]+ (it becomes a NATS token)")
    return value


@dataclass(frozen=True)
class Subjects:
    """Subject and stream names of one run."""

    run: str

    def __post_init__(self) -> None:
        _check_token(self.run, "run id")

    @property
    def root(self) -> str:
        return f"dora.{self.run}"

    # durable data
    @property
    def prompts(self) -> str:
        return f"{self.root}.prompts"

    def requests(self, version: int) -> str:
        return f"{self.root}.requests.v{int(version)}"

    @property
    def requests_all(self) -> str:
        return f"{self.root}.requests.*"

    @property
    def trajectories(self) -> str:
        return f"{self.root}.trajectories"

    @property
    def scored(self) -> str:
        return f"{self.root}.scored"

    @property
    def weights(self) -> str:
        return f"{self.root}.weights"

    @property
    def deadletter(self) -> str:
        return f"{self.root}.deadletter"

    @property
    def migrations(self) -> str:
        return f"{self.root}.migrations"

    @property
    def metrics(self) -> str:
        return f"{self.root}.metrics"

    def env_steps(self, owner: str) -> str:
        """Steps for one environment replica (``any``: whichever takes it, for a reset)."""
        return f"{self.root}.env_steps.{_check_token(owner, 'environment replica')}"

    def env_replies(self, episode_id: str) -> str:
        """The replies of one episode, kept so an engine it migrated to can read them."""
        return f"{self.root}.env_replies.{episode_token(episode_id)}"

    @property
    def env_replies_all(self) -> str:
        return f"{self.root}.env_replies.*"

    def replay(self, family: str) -> str:
        """Where the replay writer keeps a copy of ``family`` for late readers."""
        return f"{self.root}.replay.{_check_token(family, 'replayed family')}"

    # live control plane (core NATS, not persisted)
    def status(self, engine: str) -> str:
        return f"{self.root}.status.{_check_token(engine, 'engine id')}"

    @property
    def status_all(self) -> str:
        return f"{self.root}.status.*"

    def control(self, engine: str) -> str:
        return f"{self.root}.control.{_check_token(engine, 'engine id')}"

    def rpc(self, name: str) -> str:
        return f"{self.root}.rpc.{_check_token(name, 'rpc name')}"

    # JetStream names (streams, buckets) may not contain dots
    def stream(self, family: str) -> str:
        return f"DORA_{self.run}_{_check_token(family, 'stream family')}".upper().replace("-", "_")

    @property
    def blob_bucket(self) -> str:
        return f"dora_{self.run}_blobs".replace("-", "_")

    @property
    def kv_bucket(self) -> str:
        return f"dora_{self.run}_state".replace("-", "_")

    def resolve(self, name: str) -> str:
        """A subject (or wildcard pattern) from what a person types: a full subject
        (``dora.r1.scored``), a family (``trajectories``; ``requests``, ``status``, ``control``
        and ``rpc`` mean all of theirs) or a family with its rest (``requests.v3``, ``status.e0``).
        """
        if name.startswith("dora."):
            return name
        family, _, rest = name.partition(".")
        if family not in DURABLE_FAMILIES and family not in LIVE_FAMILIES:
            known = ", ".join((*DURABLE_FAMILIES, *LIVE_FAMILIES))
            raise ValueError(f"unknown subject family {family!r}; expected one of: {known}")
        if rest:
            return f"{self.root}.{family}.{rest}"
        if family in FAMILIES_WITH_CHILDREN:
            return f"{self.root}.{family}.*"
        return self.family(family)

    def family(self, family: str) -> str:
        return f"{self.root}.{_check_token(family, 'subject family')}"

    def family_of(self, subject: str) -> str:
        """The stream family a subject belongs to (``requests`` for ``requests.v3``)."""
        prefix = self.root + "."
        if not subject.startswith(prefix):
            raise ValueError(f"subject {subject!r} is not under {prefix}")
        return subject[len(prefix) :].split(".", 1)[0]


DURABLE_FAMILIES = (
    "prompts",
    "requests",
    "trajectories",
    "scored",
    "weights",
    "deadletter",
    "migrations",
    "metrics",
    "env_steps",
    "env_replies",
    "replay",
)
"""Families that JetStream persists; the rest (status, control, rpc) are live core subjects."""

LIVE_FAMILIES = ("status", "control", "rpc")
"""Core-NATS families: not stored, seen only while subscribed."""

FAMILIES_WITH_CHILDREN = (
    "requests",
    "status",
    "control",
    "rpc",
    "env_steps",
    "env_replies",
    "replay",
)
"""Families whose subjects carry one more token (a version, an engine, an rpc name)."""


# --------------------------------------------------------------------------- KV keys
# Keys of the run's KV bucket (``Subjects.kv_bucket``); a stage declares the ones it writes
# (``Stage.kv_writes``) and the embedded server's permissions follow.

LEDGER_KEY = "ledger"
"""The dispatcher's staleness ``Ledger``, read by the learner, orchestrator and recorder."""
DISPATCHER_KEY = "dispatcher"
"""The dispatcher's own state (``DispatcherSnapshot``), for a restarted dispatcher."""
WEIGHTS_LATEST_KEY = "weights.latest"
"""The newest ``WeightVersion`` (``weights.v<N>`` holds each one)."""
WEIGHTS_PRUNED_KEY = "weights.pruned_below"
"""Versions below this were deleted from the weight store."""


def weights_version_key(version: int) -> str:
    """The KV record of one published version, written before it is announced."""
    return f"weights.v{int(version)}"


def source_progress_key(stage: str) -> str:
    """How many prompts a source stage has published (a resumed run continues there)."""
    return f"source.{stage}"


def sink_counted_key(stage: str) -> str:
    """Set once a counting sink has counted in this run (a resume replays its journal)."""
    return f"sink.{stage}.counted"
