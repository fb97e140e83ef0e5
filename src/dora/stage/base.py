"""The Stage base class: what a stage consumes, what it emits, how hard it retries.

A stage is declared, not wired: it names subject *references* (``"prompts"``,
``"trajectories"``, ``"requests.v3"``) that ``resolve_subject`` turns into the run's subjects,
so the same stage object runs unchanged in any run.
"""

from __future__ import annotations

import hashlib
import inspect
import re
import typing
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

from dora.events import Event
from dora.subjects import DURABLE_FAMILIES, Subjects

if TYPE_CHECKING:
    from dora.stage.context import Context

_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
LIVE_FAMILIES = ("status", "control", "rpc")

Emitted = Event | Iterable[Event] | None
"""What a handler may return: one event, several, or nothing."""


class StageError(Exception):
    """A stage is declared or used wrongly (bad subject, undeclared output type...)."""


class Reject(Exception):
    """Raise from a handler to dead-letter the current event at once, without retries."""


class EmptyConfig(BaseModel):
    """Config of a stage that takes none: any key is an error."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class RetryPolicy:
    """How a failing handler is retried: nak with exponential backoff, dead letter at the end.

    ``max_deliver`` counts deliveries (the first one included); the last failing delivery
    dead-letters the event instead of nak'ing it, so it is never silently dropped.
    """

    max_deliver: int = 5
    backoff_s: float = 0.5
    backoff_factor: float = 2.0
    max_backoff_s: float = 30.0
    ack_wait_s: float = 30.0

    def delay(self, deliveries: int) -> float:
        """Seconds to wait before the next delivery after ``deliveries`` failed ones."""
        return min(
            self.backoff_s * self.backoff_factor ** max(deliveries - 1, 0), self.max_backoff_s
        )


def resolve_subject(subjects: Subjects, ref: str) -> str:
    """``"trajectories"`` -> ``dora.<run>.trajectories``; the family must be a known one."""
    family = ref.split(".", 1)[0]
    known = (*DURABLE_FAMILIES, *LIVE_FAMILIES)
    if family not in known:
        raise StageError(f"subject {ref!r}: unknown family {family!r}; known: {', '.join(known)}")
    return f"{subjects.root}.{ref}"


def derived_id(*parts: object) -> str:
    """A deterministic event id from its parents (e.g. the input event id and an index).

    Publishing dedupes by event id, so a handler that derives its output ids from its input
    id publishes each output exactly once even when its input is redelivered.
    """
    joined = "\x1f".join(str(p) for p in parts)
    return hashlib.sha256(joined.encode()).hexdigest()[:40]


def input_model_of(func: Any, skip_self: bool = False) -> type[Event] | None:
    """The Event subclass annotated on the first parameter of ``func`` (None for a source)."""
    params = list(inspect.signature(func).parameters.values())
    if skip_self and params:
        params = params[1:]
    if not params:
        return None
    hints = typing.get_type_hints(func)
    hint = hints.get(params[0].name)
    if isinstance(hint, type) and issubclass(hint, Event):
        return hint
    return None


class Stage:
    """Base of every stage. Subclass it and set the class attributes, then either

    - override ``handle(self, event: InModel, ctx) -> Emitted`` (a processor or a sink), or
    - override ``produce(self, ctx) -> AsyncIterator[Event]`` (a source: no input).

    Class attributes (all optional; instances may override them):

    ``name``           unique in a pipeline; also the durable consumer name.
    ``consumes``       subject reference of the input (None for a source).
    ``input_model``    Event subclass of the input; default: the annotation of ``handle``.
    ``emits``          ``{EventType: "subject.ref"}``: where each returned event goes.
    ``concurrency``    events handled at once per replica (and the consumer's ack window).
    ``retry``          a ``RetryPolicy``.
    ``finite``         the stage finishes by itself (sources when ``produce`` returns,
                       others when they call ``ctx.complete()``); a pipeline run ends when
                       all its finite stages have finished.
    ``Config``         pydantic model of the keyword config (YAML ``config:``); ``self.config``.
    ``publishes``      subject families the stage publishes on itself (``ctx.bus``), beyond
                       ``emits``: on a run's embedded server, its login may publish on these,
                       ``emits`` and ``deadletter`` only.
    ``kv_writes``      KV keys (NATS wildcards allowed, ``{name}`` = the stage's name) it
                       writes; the login may write no other.
    ``hosts_replicas`` a service stage (a source) that runs one copy of its service per
                       replica itself, e.g. one engine per generator replica: in one process
                       it hosts every replica, under ``dora stage serve --replica I`` only
                       replica I; ``self.replica_ids`` says which.
    """

    name: ClassVar[str] = ""
    consumes: ClassVar[str | None] = None
    input_model: ClassVar[type[Event] | None] = None
    emits: ClassVar[Mapping[type[Event], str]] = {}
    concurrency: ClassVar[int] = 1
    retry: ClassVar[RetryPolicy] = RetryPolicy()
    finite: ClassVar[bool] = False
    Config: ClassVar[type[BaseModel]] = EmptyConfig
    publishes: ClassVar[tuple[str, ...]] = ()
    kv_writes: ClassVar[tuple[str, ...]] = ()
    hosts_replicas: ClassVar[bool] = False
    replica_ids: tuple[int, ...] = (0,)

    def __init__(
        self,
        *,
        name: str | None = None,
        concurrency: int | None = None,
        retry: RetryPolicy | None = None,
        consumes: str | None = None,
        **config: Any,
    ) -> None:
        self.config = self.Config.model_validate(config)
        if consumes is not None:  # e.g. one generator class serving requests.v3
            self.consumes = consumes  # type: ignore[misc]
        default_name = type(self).name or _snake(type(self).__name__)
        self.name = name or default_name  # type: ignore[misc]
        if concurrency is not None:
            self.concurrency = concurrency  # type: ignore[misc]
        if retry is not None:
            self.retry = retry  # type: ignore[misc]
        if self.input_model is None and self.is_processor:
            self.input_model = input_model_of(type(self).handle, skip_self=True)  # type: ignore[misc]
        self.validate()

    # ----------------------------------------------------------------- declaration

    @property
    def is_source(self) -> bool:
        return type(self).produce is not Stage.produce

    @property
    def is_processor(self) -> bool:
        return type(self).handle is not Stage.handle

    def validate(self) -> None:
        """Refuse an inconsistent declaration early, with the stage named."""
        if not _NAME.match(self.name):
            raise StageError(f"stage name {self.name!r} must match [A-Za-z0-9_-]+")
        if self.concurrency < 1:
            raise StageError(f"stage {self.name}: concurrency must be >= 1")
        if self.is_source == self.is_processor:
            raise StageError(f"stage {self.name}: override exactly one of produce() or handle()")
        if self.is_processor:
            if self.consumes is None:
                raise StageError(f"stage {self.name}: a handler stage must set `consumes`")
            if self.input_model is None:
                raise StageError(
                    f"stage {self.name}: no input model; annotate the event parameter of "
                    "handle() with an Event subclass or set `input_model`"
                )
        for model in self.emits:
            if not (isinstance(model, type) and issubclass(model, Event)):
                raise StageError(f"stage {self.name}: emits key {model!r} is not an Event type")

    def published_families(self) -> set[str]:
        """Every subject family this stage may publish on (its login's permissions)."""
        emitted = {ref.split(".", 1)[0] for ref in self.emits.values()}
        return {*emitted, *self.publishes, "deadletter"}

    def written_kv_keys(self) -> tuple[str, ...]:
        return tuple(key.format(name=self.name) for key in self.kv_writes)

    def clone(self, **overrides: Any) -> Stage:
        """A fresh instance with the same config, some of it overridden (YAML ``config``)."""
        config = {**self.config.model_dump(), **overrides.pop("config", {})}
        kwargs = {
            "name": self.name,
            "concurrency": self.concurrency,
            "retry": self.retry,
            "consumes": self.consumes,
        }
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        return type(self)(**kwargs, **config)

    # ----------------------------------------------------------------- behaviour

    async def setup(self, ctx: Context) -> None:
        """Called once before the first event (open models, tasks, files)."""

    async def teardown(self, ctx: Context) -> None:
        """Called once after the last event, also after a failure."""

    async def handle(self, event: Any, ctx: Context) -> Emitted:
        """Process one input event; return the events to publish (or use ``ctx.publish``)."""
        raise NotImplementedError

    def produce(self, ctx: Context) -> AsyncIterator[Event]:
        """A source's events; each yielded event is published before the next is asked for."""
        raise NotImplementedError

    def progress_total(self) -> int | None:
        """How many events this stage expects to handle or produce, when it knows (progress)."""
        return None

    def progress_done(self) -> int | None:
        """Work done so far, for a service stage whose work is not the events its runner
        handles (a rollout fleet's finished trajectories); None: the runner's count."""
        return None

    def summary(self) -> dict[str, Any]:
        """Stage-specific results for the run summary (JSON-serializable)."""
        return {}


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
