"""In-process bus with JetStream's semantics, for unit tests.

``MemoryBroker`` plays the server (streams, durable consumer state, blobs, KV); each
``MemoryBus`` is a client of it, so "reconnect" and "another process" can be tested by opening
a second client on the same broker. It passes the same contract suite as ``NatsBus``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from dora.bus.base import (
    BlobNotFound,
    Bus,
    BusError,
    Consumer,
    ConsumerSpec,
    ConsumerState,
    Handler,
    Message,
    NoResponders,
    PublishResult,
    PublishTimeout,
    RequestTimeout,
    StartAt,
    StoredMessage,
    StreamSpec,
    StreamState,
    Subscription,
)
from dora.bus.matching import subject_matches
from dora.events import BlobRef
from dora.subjects import Subjects

LIVE_QUEUE_LIMIT = 65_536
"""Like a core-NATS slow consumer, a live subscriber that falls this far behind loses messages."""


@dataclass
class _Stored:
    seq: int
    subject: str
    data: bytes
    headers: dict[str, str]
    stored_at: float = field(default_factory=time.monotonic)


@dataclass
class _ConsumerRecord:
    spec: ConsumerSpec
    stream: _Stream
    delivered_upto: int = 0
    unacked: dict[int, float] = field(default_factory=dict)  # seq -> ack deadline
    ready: dict[int, float] = field(default_factory=dict)  # seq -> redelivery time
    deliveries: dict[int, int] = field(default_factory=dict)
    redelivered: int = 0

    def wants(self, msg: _Stored) -> bool:
        return subject_matches(self.spec.filter_subject, msg.subject)


@dataclass
class _Stream:
    spec: StreamSpec
    name: str
    patterns: tuple[str, ...]
    messages: dict[int, _Stored] = field(default_factory=dict)
    seq: int = 0
    nbytes: int = 0
    dedupe: dict[str, tuple[int, float]] = field(default_factory=dict)
    consumers: dict[str, _ConsumerRecord] = field(default_factory=dict)
    acked: dict[int, set[str]] = field(default_factory=dict)

    def is_full(self) -> bool:
        over_bytes = 0 <= self.spec.max_bytes <= self.nbytes
        return 0 <= self.spec.max_msgs <= len(self.messages) or over_bytes

    def remove(self, seq: int) -> None:
        msg = self.messages.pop(seq, None)
        if msg is not None:
            self.nbytes -= len(msg.data)
        self.acked.pop(seq, None)
        for rec in self.consumers.values():
            rec.unacked.pop(seq, None)
            rec.ready.pop(seq, None)
            rec.deliveries.pop(seq, None)

    def settle(self, seq: int, durable: str) -> None:
        """A consumer is done with ``seq``: drop the message once nobody else needs it."""
        if self.spec.retention == "limits" or seq not in self.messages:
            return
        done = self.acked.setdefault(seq, set())
        done.add(durable)
        msg = self.messages[seq]
        interested = {name for name, rec in self.consumers.items() if rec.wants(msg)}
        if interested <= done:
            self.remove(seq)

    def trim(self) -> None:
        """Limits retention: discard the oldest messages beyond the limits."""
        while self.messages and self.is_full():
            self.remove(next(iter(self.messages)))

    def expire(self) -> None:
        """``max_age_s``: discard messages older than that, whatever their retention."""
        if self.spec.max_age_s <= 0:
            return
        horizon = time.monotonic() - self.spec.max_age_s
        while self.messages:
            seq, msg = next(iter(self.messages.items()))
            if msg.stored_at > horizon:
                break
            self.remove(seq)


class MemoryBroker:
    """The in-process 'server': shared by every MemoryBus client of one test."""

    def __init__(self) -> None:
        self.streams: dict[str, _Stream] = {}
        self.live: list[tuple[str, asyncio.Queue[_LiveMessage]]] = []
        self.services: list[tuple[str, Handler]] = []
        self.blobs: dict[str, bytes] = {}
        self.kv: dict[str, tuple[bytes, int]] = {}
        self.kv_revision = itertools.count(1)
        self.leases: dict[str, Message] = {}
        self._changed: asyncio.Condition | None = None

    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait(self, timeout: float) -> None:
        async with self.changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout=max(timeout, 0.0))

    def stream_for(self, subject: str) -> _Stream | None:
        for stream in self.streams.values():
            if any(subject_matches(p, subject) for p in stream.patterns):
                return stream
        return None


class _LiveMessage(Message):
    def __init__(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        self.subject = subject
        self.data = data
        self.headers = headers or {}
        self.num_delivered = 1
        self.stream_seq = 0

    async def ack(self, *, wait: bool = False) -> None:
        return None

    async def nak(self, delay: float | None = None) -> None:
        return None

    async def term(self) -> None:
        return None

    async def in_progress(self) -> None:
        return None


class _DurableMessage(Message):
    def __init__(self, broker: MemoryBroker, rec: _ConsumerRecord, stored: _Stored) -> None:
        self._broker = broker
        self._rec = rec
        self.subject = stored.subject
        self.data = stored.data
        self.headers = dict(stored.headers)
        self.stream_seq = stored.seq
        self.num_delivered = rec.deliveries.get(stored.seq, 1)
        self.ack_token = (
            f"mem.{rec.stream.name}.{rec.spec.durable}.{stored.seq}.{self.num_delivered}"
        )
        broker.leases[self.ack_token] = self

    async def ack(self, *, wait: bool = False) -> None:
        self._rec.unacked.pop(self.stream_seq, None)
        self._rec.ready.pop(self.stream_seq, None)
        self._rec.stream.settle(self.stream_seq, self._rec.spec.durable)
        await self._broker.notify()

    async def term(self) -> None:
        await self.ack()

    async def nak(self, delay: float | None = None) -> None:
        if self._rec.unacked.pop(self.stream_seq, None) is not None:
            self._rec.ready[self.stream_seq] = time.monotonic() + (delay or 0.0)
        await self._broker.notify()

    async def in_progress(self) -> None:
        if self.stream_seq in self._rec.unacked:
            self._rec.unacked[self.stream_seq] = time.monotonic() + self._rec.spec.ack_wait_s


class _MemoryConsumer(Consumer):
    def __init__(self, broker: MemoryBroker, rec: _ConsumerRecord) -> None:
        self._broker = broker
        self._rec = rec
        self.spec = rec.spec
        self._closed = False

    def _take(self, batch: int) -> tuple[list[Message], float | None]:
        """Deliverable messages now, and when the next one becomes deliverable."""
        rec, stream, now = self._rec, self._rec.stream, time.monotonic()
        for seq, deadline in list(rec.unacked.items()):
            if deadline <= now:
                del rec.unacked[seq]
                rec.ready[seq] = now
        out: list[Message] = []
        room = rec.spec.max_ack_pending - len(rec.unacked)
        wake: float | None = min(rec.unacked.values(), default=None)
        for seq, at in sorted(rec.ready.items()):
            if len(out) >= min(batch, room):
                break
            if at > now:
                wake = at if wake is None else min(wake, at)
                continue
            if rec.deliveries.get(seq, 0) >= rec.spec.max_deliver or seq not in stream.messages:
                del rec.ready[seq]
                continue
            del rec.ready[seq]
            out.append(self._deliver(seq, redelivery=True))
        for seq in range(rec.delivered_upto + 1, stream.seq + 1):
            if len(out) >= min(batch, room):
                break
            rec.delivered_upto = seq
            stored = stream.messages.get(seq)
            if stored is not None and rec.wants(stored):
                out.append(self._deliver(seq, redelivery=False))
        return out, wake

    def _deliver(self, seq: int, *, redelivery: bool) -> Message:
        rec = self._rec
        rec.deliveries[seq] = rec.deliveries.get(seq, 0) + 1
        rec.redelivered += int(redelivery)
        rec.unacked[seq] = time.monotonic() + rec.spec.ack_wait_s
        return _DurableMessage(self._broker, rec, rec.stream.messages[seq])

    async def fetch(self, batch: int = 1, timeout: float = 1.0) -> list[Message]:
        if self._closed:
            raise BusError("consumer is closed")
        deadline = time.monotonic() + timeout
        while True:
            self._rec.stream.expire()
            out, wake = self._take(batch)
            now = time.monotonic()
            if out or now >= deadline:
                return out
            until = deadline if wake is None else min(deadline, wake)
            await self._broker.wait(until - now)

    async def state(self) -> ConsumerState:
        rec, stream = self._rec, self._rec.stream
        pending = sum(
            1 for seq, m in stream.messages.items() if seq > rec.delivered_upto and rec.wants(m)
        )
        # as JetStream: a message handed back (nak) or past its ack wait stays "ack pending"
        # until it is delivered again, it does not return to the undelivered count
        return ConsumerState(
            pending=pending,
            ack_pending=len(rec.unacked) + len(rec.ready),
            redelivered=rec.redelivered,
        )

    async def close(self) -> None:
        self._closed = True


class _MemorySubscription(Subscription):
    def __init__(self, broker: MemoryBroker, entry: tuple[str, object]) -> None:
        self._broker = broker
        self._entry = entry

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Message]:
        queue = self._entry[1]
        assert isinstance(queue, asyncio.Queue)
        while True:
            msg = await queue.get()
            if msg is None:
                return
            yield msg

    async def unsubscribe(self) -> None:
        for entries in (self._broker.live, self._broker.services):
            if self._entry in entries:
                entries.remove(self._entry)  # type: ignore[arg-type]
        queue = self._entry[1]
        if isinstance(queue, asyncio.Queue):
            queue.put_nowait(None)


class MemoryBus(Bus):
    """A client of a ``MemoryBroker``; same contract as ``NatsBus``."""

    def __init__(
        self,
        subjects: Subjects,
        broker: MemoryBroker | None = None,
        streams: tuple[StreamSpec, ...] | None = None,
    ) -> None:
        super().__init__(subjects, streams)
        self.broker = broker or MemoryBroker()
        self._subs: list[Subscription] = []
        self._connected = False

    async def connect(self) -> None:
        for spec in self.streams:
            name = self.subjects.stream(spec.family)
            if name not in self.broker.streams:
                family = f"{self.subjects.root}.{spec.family}"
                self.broker.streams[name] = _Stream(spec, name, (family, f"{family}.>"))
        self._connected = True

    async def close(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()
        self._connected = False

    def _require(self) -> None:
        if not self._connected:
            raise BusError("bus is not connected")

    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> PublishResult | None:
        self._require()
        stream = self.broker.stream_for(subject)
        if stream is None:
            self._fan_out(subject, data, headers)
            return None
        hdrs = dict(headers or {})
        now = time.monotonic()
        if msg_id is not None:
            hdrs["Nats-Msg-Id"] = msg_id
            window = stream.spec.duplicate_window_s
            stream.dedupe = {k: v for k, v in stream.dedupe.items() if now - v[1] < window}
            if msg_id in stream.dedupe:
                return PublishResult(stream.name, stream.dedupe[msg_id][0], duplicate=True)
        deadline = None if timeout is None else now + timeout
        while stream.spec.blocks_when_full and stream.is_full():
            if deadline is not None and time.monotonic() >= deadline:
                raise PublishTimeout(f"stream {stream.name} stayed full for {timeout}s")
            await self.broker.wait(0.05 if deadline is None else deadline - time.monotonic())
        stream.seq += 1
        if msg_id is not None:
            stream.dedupe[msg_id] = (stream.seq, now)
        stored = _Stored(stream.seq, subject, data, hdrs)
        interested = any(rec.wants(stored) for rec in stream.consumers.values())
        if stream.spec.retention != "interest" or interested:
            stream.messages[stream.seq] = stored
            stream.nbytes += len(data)
        if stream.spec.retention == "limits":
            stream.trim()
        stream.expire()
        self._fan_out(subject, data, hdrs)  # as in NATS, live subscribers see stored messages
        await self.broker.notify()
        return PublishResult(stream.name, stream.seq)

    def _fan_out(self, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
        for pattern, queue in list(self.broker.live):
            if subject_matches(pattern, subject) and queue.qsize() < LIVE_QUEUE_LIMIT:
                queue.put_nowait(_LiveMessage(subject, data, headers))

    def _stream_of(self, subject: str) -> _Stream:
        """The stream of ``subject``'s family (wildcards allowed), like NatsBus resolves it."""
        self._require()
        stream = self.broker.streams.get(self.subjects.stream(self.subjects.family_of(subject)))
        if stream is None:
            raise BusError(f"subject {subject!r} belongs to no durable stream")
        stream.expire()
        return stream

    async def consumer(self, spec: ConsumerSpec) -> Consumer:
        stream = self._stream_of(spec.filter_subject)
        rec = stream.consumers.get(spec.durable)
        if rec is None:
            rec = _ConsumerRecord(spec, stream)
            stream.consumers[spec.durable] = rec
        elif rec.spec.filter_subject != spec.filter_subject:
            raise BusError(
                f"consumer {spec.durable!r} exists with filter {rec.spec.filter_subject!r}"
            )
        return _MemoryConsumer(self.broker, rec)

    async def delete_consumer(self, subject: str, durable: str) -> None:
        stream = self.broker.stream_for(subject)
        if stream is not None and stream.consumers.pop(durable, None) is not None:
            for seq in list(stream.messages):
                if stream.spec.retention == "interest":
                    stream.settle(seq, durable)

    async def stream_info(self, subject: str) -> StreamState:
        stream = self._stream_of(subject)
        first = next(iter(stream.messages), stream.seq + 1)
        return StreamState(
            stream=stream.name,
            messages=len(stream.messages),
            bytes=stream.nbytes,
            first_seq=first,
            last_seq=stream.seq,
            consumers=len(stream.consumers),
        )

    async def stored_by_subject(self, subject: str) -> dict[str, int]:
        stream = self._stream_of(subject)
        return dict(Counter(m.subject for m in stream.messages.values()))

    async def stream_messages(
        self,
        subject: str,
        *,
        start: StartAt = "first",
        follow: bool = False,
        poll_s: float = 0.2,
    ) -> AsyncIterator[StoredMessage]:
        stream = self._stream_of(subject)
        seq = stream.seq + 1 if start == "new" else 1 if start == "first" else int(start)
        while True:
            found = next(
                (
                    m
                    for s, m in stream.messages.items()
                    if s >= seq and subject_matches(subject, m.subject)
                ),
                None,
            )
            if found is not None:
                seq = found.seq + 1
                yield StoredMessage(found.subject, found.data, dict(found.headers), found.seq)
                continue
            if not follow:
                return
            await self.broker.wait(poll_s)

    async def subscribe(self, subject: str) -> Subscription:
        self._require()
        entry: tuple[str, asyncio.Queue[_LiveMessage]] = (subject, asyncio.Queue())
        self.broker.live.append(entry)
        sub = _MemorySubscription(self.broker, entry)
        self._subs.append(sub)
        return sub

    async def request(self, subject: str, data: bytes, timeout: float = 5.0) -> bytes:
        self._require()
        handlers = [h for pattern, h in self.broker.services if subject_matches(pattern, subject)]
        if not handlers:
            raise NoResponders(f"no service answers {subject!r}")
        try:
            return await asyncio.wait_for(handlers[0](data), timeout=timeout)
        except TimeoutError as exc:
            raise RequestTimeout(f"no reply on {subject!r} within {timeout}s") from exc

    async def serve(self, subject: str, handler: Handler) -> Subscription:
        self._require()
        entry = (subject, handler)
        self.broker.services.append(entry)
        sub = _MemorySubscription(self.broker, entry)  # type: ignore[arg-type]
        self._subs.append(sub)
        return sub

    async def put_blob(self, name: str, data: bytes) -> BlobRef:
        self.broker.blobs[name] = bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        return BlobRef(bucket=self.subjects.blob_bucket, name=name, size=len(data), sha256=digest)

    async def get_blob(self, name: str) -> bytes:
        try:
            return self.broker.blobs[name]
        except KeyError as exc:
            raise BlobNotFound(name) from exc

    async def delete_blob(self, name: str) -> None:
        self.broker.blobs.pop(name, None)

    def lease(self, ack_token: str) -> Message:
        try:
            return self.broker.leases[ack_token]
        except KeyError as exc:
            raise BusError(f"unknown ack token {ack_token!r}") from exc

    async def kv_put(self, key: str, value: bytes) -> int:
        revision = next(self.broker.kv_revision)
        self.broker.kv[key] = (bytes(value), revision)
        return revision

    async def kv_get(self, key: str) -> bytes | None:
        entry = self.broker.kv.get(key)
        return None if entry is None else entry[0]

    async def kv_delete(self, key: str) -> None:
        self.broker.kv.pop(key, None)
