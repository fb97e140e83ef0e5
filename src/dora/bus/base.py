"""The Bus protocol every stage talks to, and the vocabulary shared by its implementations.

Two families of subjects exist. *Durable* ones (``dora.subjects.DURABLE_FAMILIES``) live in
JetStream streams: publishing waits for the server to store the message (and blocks while the
stream is full, which is how a slow consumer slows its producer), and they are read through
durable pull consumers with explicit acks. *Live* ones (status, control, rpc) are plain
core-NATS subjects: cheap, not stored, for data that is re-sent anyway.

Observers (``dora tail``, audits) read a stream with ``stream_messages`` (no consumer, no acks,
no effect on the work) and size it with ``stream_info``. Fan-out (interest) streams keep a
message only for consumers that exist when it is published: create durable consumers before
their producers start.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from dora.events import BlobRef, Event
from dora.subjects import DURABLE_FAMILIES, Subjects

Retention = Literal["work", "interest", "limits"]


class BusError(Exception):
    """Base of every bus failure."""


class RequestError(BusError):
    """A request-reply call got no reply."""


class RequestTimeout(RequestError):
    """Nobody answered within the timeout."""


class NoResponders(RequestError):
    """No service listens on that subject."""


class PublishTimeout(BusError):
    """The stream stayed full (or the server silent) for longer than the publish timeout."""


class BlobNotFound(BusError):
    """No blob of that name in the object store."""


@dataclass(frozen=True)
class StreamSpec:
    """One durable stream: a subject family and how long its messages are kept.

    ``work``: a message is removed once acked (one consumer per subject, e.g. request queues);
    ``interest``: removed once every consumer has acked it (fan-out, e.g. trajectories);
    ``limits``: kept until the limits push it out (audit streams: weights, dead letters).
    Work and interest streams refuse new messages when full, so producers wait; a limits
    stream discards its oldest. ``max_age_s`` > 0 discards messages older than that.
    """

    family: str
    retention: Retention
    max_msgs: int = 100_000
    max_bytes: int = -1
    duplicate_window_s: float = 120.0
    max_age_s: float = 0.0

    @property
    def blocks_when_full(self) -> bool:
        return self.retention != "limits"


RETENTION: dict[str, Retention] = {
    "prompts": "work",
    "requests": "work",
    "trajectories": "interest",
    "scored": "interest",
    "env_steps": "work",
}
"""Retention of each durable family; any other keeps ``limits``."""


@dataclass(frozen=True)
class ReplayLimits:
    """How long the ``replay`` stream keeps its copies (see ``dora.stages.replay_writer``):
    the oldest go first once a message is ``max_age_s`` old or the stream holds
    ``max_bytes`` (-1: no size limit)."""

    max_age_s: float = 86_400.0
    max_bytes: int = -1


def default_streams(
    max_msgs: int = 100_000, replay: ReplayLimits | None = None
) -> tuple[StreamSpec, ...]:
    """The streams of one run, with ``max_msgs`` as the backpressure bound of work queues;
    with ``replay``, also the replay stream, bounded by age and size (never by count)."""
    specs = [
        StreamSpec(family, RETENTION.get(family, "limits"), max_msgs=max_msgs)
        for family in DURABLE_FAMILIES
        if family != "replay"
    ]
    if replay is not None:
        specs.append(
            StreamSpec(
                "replay",
                "limits",
                max_msgs=-1,
                max_bytes=replay.max_bytes,
                max_age_s=replay.max_age_s,
                duplicate_window_s=min(StreamSpec.duplicate_window_s, replay.max_age_s),
            )
        )
    return tuple(specs)


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer; ``max_ack_pending`` bounds how much it holds unacked."""

    durable: str
    filter_subject: str
    max_ack_pending: int = 256
    max_deliver: int = 5
    ack_wait_s: float = 30.0


@dataclass(frozen=True)
class ConsumerState:
    """Counts of a consumer: not yet delivered, delivered but unacked, redelivered."""

    pending: int
    ack_pending: int
    redelivered: int

    @property
    def depth(self) -> int:
        """Work not yet done: the queue depth the orchestrator reads."""
        return self.pending + self.ack_pending


@dataclass(frozen=True)
class PublishResult:
    """Where a durable publish landed; ``duplicate`` when dedupe swallowed it."""

    stream: str
    seq: int
    duplicate: bool = False


@dataclass(frozen=True)
class StreamState:
    """What a durable stream holds right now (messages stored, their bytes, sequence range)."""

    stream: str
    messages: int
    bytes: int
    first_seq: int
    last_seq: int
    consumers: int


@dataclass(frozen=True)
class StoredMessage:
    """A message read from a stream without consuming it (no ack, no effect on consumers)."""

    subject: str
    data: bytes
    headers: dict[str, str]
    stream_seq: int

    @property
    def msg_id(self) -> str | None:
        return self.headers.get("Nats-Msg-Id")


StartAt = int | Literal["first", "new"]
"""Where a stream read starts: a stream sequence, the oldest stored message, or after the last."""


class Message(abc.ABC):
    """A delivered message. Durable ones must be acked, nak'ed or termed."""

    subject: str
    data: bytes
    headers: dict[str, str]
    num_delivered: int
    stream_seq: int
    ack_token: str = ""
    """Handle that lets any client of the same server settle this message (``Bus.lease``)."""

    @property
    def msg_id(self) -> str | None:
        return self.headers.get("Nats-Msg-Id")

    @abc.abstractmethod
    async def ack(self, *, wait: bool = False) -> None:
        """Done: never deliver again.

        Acks are sent without waiting (one round trip per message would halve throughput), so
        consumer and stream counts may show them a moment later; ``wait=True`` returns only once
        the server has applied this ack and every earlier one of the consumer."""

    @abc.abstractmethod
    async def nak(self, delay: float | None = None) -> None:
        """Not done: deliver again (after ``delay`` seconds)."""

    @abc.abstractmethod
    async def term(self) -> None:
        """Never deliver again, without success (after dead-lettering it)."""

    @abc.abstractmethod
    async def in_progress(self) -> None:
        """Still working: reset the ack timer."""


class Consumer(abc.ABC):
    """A durable pull consumer bound to one stream."""

    spec: ConsumerSpec

    @abc.abstractmethod
    async def fetch(self, batch: int = 1, timeout: float = 1.0) -> list[Message]:
        """Up to ``batch`` messages; an empty list when none came within ``timeout``."""

    @abc.abstractmethod
    async def state(self) -> ConsumerState:
        """Pending and unacked counts, from the server (acks sent without ``wait`` may show a
        moment later)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop fetching (the durable consumer itself stays on the server)."""

    async def release_buffered(self) -> int:
        """Hand back (nak) messages delivered to this client that no fetch returned; how many.

        A fetch can return while messages its pull requests asked for are still arriving; they
        wait in the client until the next fetch on this consumer. A reader that stops fetching
        (an engine moved to another version) must hand them back, or they sit unacked and
        unserved until the ack wait expires. A bus without a client-side buffer has none.
        """
        return 0


class Subscription(abc.ABC):
    """A live (core) subscription: an async iterator of messages."""

    @abc.abstractmethod
    def __aiter__(self) -> AsyncIterator[Message]: ...

    @abc.abstractmethod
    async def unsubscribe(self) -> None: ...


Handler = Callable[[bytes], Awaitable[bytes]]


class Bus(abc.ABC):
    """Transport of one run: durable streams, live subjects, request-reply, blobs, KV."""

    def __init__(self, subjects: Subjects, streams: tuple[StreamSpec, ...] | None = None) -> None:
        self.subjects = subjects
        self.streams = streams if streams is not None else default_streams()

    async def __aenter__(self) -> Bus:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def is_durable(self, subject: str) -> bool:
        return self.subjects.family_of(subject) in {s.family for s in self.streams}

    def stream_spec(self, subject: str) -> StreamSpec:
        family = self.subjects.family_of(subject)
        for spec in self.streams:
            if spec.family == family:
                return spec
        raise BusError(f"subject {subject!r} belongs to no durable stream")

    async def publish_event(
        self, subject: str, event: Event, *, timeout: float | None = None
    ) -> PublishResult | None:
        """Publish an event as JSON, deduplicated by its ``event_id``."""
        return await self.publish(
            subject, event.model_dump_json().encode(), msg_id=event.event_id, timeout=timeout
        )

    @abc.abstractmethod
    async def connect(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> PublishResult | None:
        """Durable subjects: store (waiting while the stream is full); live: fire and forget."""

    @abc.abstractmethod
    async def consumer(self, spec: ConsumerSpec) -> Consumer:
        """Create (or bind to) a durable pull consumer."""

    @abc.abstractmethod
    async def delete_consumer(self, subject: str, durable: str) -> None: ...

    @abc.abstractmethod
    async def subscribe(self, subject: str) -> Subscription:
        """Live subscription (wildcards ``*`` and ``>`` allowed)."""

    @abc.abstractmethod
    async def request(self, subject: str, data: bytes, timeout: float = 5.0) -> bytes:
        """Send and wait for one reply; RequestTimeout / NoResponders otherwise."""

    @abc.abstractmethod
    async def serve(self, subject: str, handler: Handler) -> Subscription:
        """Answer requests on ``subject`` with ``handler``."""

    @abc.abstractmethod
    async def stream_info(self, subject: str) -> StreamState:
        """State of the durable stream that holds ``subject`` (any subject of its family)."""

    @abc.abstractmethod
    async def stored_by_subject(self, subject: str) -> dict[str, int]:
        """Messages stored right now per subject, in the stream that holds ``subject``
        (``requests.v3``: 12, ``requests.v4``: 2): what no consumer has taken yet."""

    @abc.abstractmethod
    def stream_messages(
        self,
        subject: str,
        *,
        start: StartAt = "first",
        follow: bool = False,
        poll_s: float = 0.2,
    ) -> AsyncIterator[StoredMessage]:
        """Read the stored messages matching ``subject`` (wildcards allowed) in stream order,
        without consuming them: no consumer is created, nothing is acked, work queues keep their
        work. ``follow`` keeps waiting for new messages (checking every ``poll_s``) instead of
        ending at the last one. For ``dora tail`` and audit tools."""

    @abc.abstractmethod
    async def put_blob(self, name: str, data: bytes) -> BlobRef: ...

    @abc.abstractmethod
    async def get_blob(self, name: str) -> bytes: ...

    @abc.abstractmethod
    async def delete_blob(self, name: str) -> None: ...

    @abc.abstractmethod
    def lease(self, ack_token: str) -> Message:
        """A handle to settle a durable message delivered to someone else (by its ack token).

        Lets a request's queue message move with the request when it migrates between engines:
        whichever engine finishes the request acks it; if that engine dies, it is redelivered.
        """

    @abc.abstractmethod
    async def kv_put(self, key: str, value: bytes) -> int:
        """Store ``value``; returns the new revision."""

    @abc.abstractmethod
    async def kv_get(self, key: str) -> bytes | None: ...

    @abc.abstractmethod
    async def kv_delete(self, key: str) -> None: ...
