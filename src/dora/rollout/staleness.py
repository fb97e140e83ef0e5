"""Per-version staleness accounting: the admission rule and the urgency rule.

Version numbering (INTERFACES.md): learner step ``s`` trains with weights ``s`` and publishes
``s + 1``. A group tagged ``u`` may be trained at step ``s`` only if ``s - u <= K``, so its
deadline step is ``u + K``; it cannot be trained before step ``u`` either (its version did not
exist earlier), and every group that exists has ``u <= s``.

Admission (why it is better than AReaL's ``(K + v + 1) * B - (accepted + running)``): the
learner consumes B groups per step. Think of each unconsumed group as a job with deadline
``u + K`` and of each future step ``s, s+1, ...`` as B slots. Earliest-deadline-first says a
schedule with at most B groups per step that meets every deadline exists iff, for every
version ``u``, the unconsumed groups of versions ``<= u`` fit in the slots of steps
``s .. u + K``::

    N(<= u) <= (u + K - s + 1) * B        for every u (with at least one group <= u)

Admitting one more group of version ``v`` adds one to ``N(<= u)`` for every ``u >= v``, so the
capacity for tag ``v`` is the smallest slack over ``u >= v``. This equals AReaL's formula when
the tag is the learner's current version and the learner consumed exactly B per step; it is
tighter (and correct) when the tag lags the learner (dora tags the newest version *with an
engine*, which may be older than the newest published one: those groups have earlier
deadlines), and it uses the real consumed counts, so an oversize batch (the learner included
urgent groups beyond B) or a slow consumer is accounted for exactly, per version.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dora.events import Ledger, VersionCounts


@dataclass
class Counts:
    """Groups of one version."""

    dispatched: int = 0
    finished: int = 0
    consumed: int = 0
    abandoned: int = 0
    """Groups that can never finish (an engine refused one of their requests)."""

    @property
    def unconsumed(self) -> int:
        """Groups still to be trained on (abandoned ones never will be: they are settled)."""
        return self.dispatched - self.consumed - self.abandoned


@dataclass
class StalenessLedger:
    """Mutable per-version group counts and the EDF admission capacity."""

    staleness_bound: int
    batch_groups: int
    learner_step: int = 0
    versions: dict[int, Counts] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.staleness_bound < 0:
            raise ValueError(f"staleness_bound must be >= 0, got {self.staleness_bound}")
        if self.batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1, got {self.batch_groups}")

    def counts(self, version: int) -> Counts:
        c = self.versions.get(version)
        if c is None:
            c = self.versions[version] = Counts()
        return c

    def unconsumed(self, upto: int | None = None) -> int:
        return sum(c.unconsumed for v, c in self.versions.items() if upto is None or v <= upto)

    def capacity(self, version: int, step: int | None = None) -> int:
        """Groups tagged ``version`` admissible now without breaking any deadline (>= 0)."""
        s = self.learner_step if step is None else step
        k, b = self.staleness_bound, self.batch_groups
        if version + k < s:
            return 0
        pending = sorted((v, c.unconsumed) for v, c in self.versions.items() if c.unconsumed)
        prefix = 0
        best = (version + k - s + 1) * b - sum(n for v, n in pending if v <= version)
        for v, n in pending:
            prefix += n
            if v >= version:
                best = min(best, (v + k - s + 1) * b - prefix)
        return max(0, best)

    def late(self) -> list[int]:
        """Versions with unconsumed groups past their deadline (must stay empty)."""
        s, k = self.learner_step, self.staleness_bound
        return sorted(v for v, c in self.versions.items() if c.unconsumed and v + k < s)

    def to_event(self) -> Ledger:
        """The ``Ledger`` event: versions still in the staleness window or not yet consumed."""
        s, k = self.learner_step, self.staleness_bound
        keep = sorted(v for v, c in self.versions.items() if c.unconsumed or v + k >= s)
        return Ledger(
            learner_step=s,
            staleness_bound=k,
            batch_groups=self.batch_groups,
            versions=tuple(
                VersionCounts(
                    version=v,
                    dispatched=self.versions[v].dispatched,
                    finished=self.versions[v].finished,
                    consumed=self.versions[v].consumed,
                    abandoned=self.versions[v].abandoned,
                )
                for v in keep
            ),
        )
