"""The production bus: NATS JetStream through nats-py.

Durable subjects go to JetStream streams created by ``connect`` (one per subject family);
blobs go to a JetStream object store (chunked, so far beyond the 1 MB message limit); small
state goes to a JetStream key-value bucket.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit

import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from dora.bus.auth import NatsAuth, required_permissions, tls_options
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
from dora.bus.outage import TRANSIENT, Outage, outage_s_from_env
from dora.events import BlobRef
from dora.subjects import Subjects

log = structlog.get_logger(__name__)

_RETENTION = {
    "work": api.RetentionPolicy.WORK_QUEUE,
    "interest": api.RetentionPolicy.INTEREST,
    "limits": api.RetentionPolicy.LIMITS,
}
_FULL_CODES = {10077, 10078}  # maximum messages / bytes exceeded (discard=new)
_BACKOFF_MAX_S = 0.05


class _NatsMessage(Message):
    def __init__(self, msg: Msg, durable: bool) -> None:
        self._msg = msg
        self._durable = durable
        self.subject = msg.subject
        self.data = msg.data
        self.headers = dict(msg.headers or {})
        self.ack_token = msg.reply or ""
        if durable:
            meta = msg.metadata
            self.num_delivered = meta.num_delivered
            self.stream_seq = meta.sequence.stream
        else:
            self.num_delivered = 1
            self.stream_seq = 0

    async def ack(self, *, wait: bool = False) -> None:
        # Fire-and-forget by default, like nak/term: ``ack_sync`` costs a round trip per message
        # (see ``dora bench bus``). A lost ack only means a redelivery (at-least-once), which
        # dedupe by event id absorbs.
        if not self._durable:
            return
        if wait:
            await self._msg.ack_sync()
        else:
            await self._msg.ack()

    async def nak(self, delay: float | None = None) -> None:
        if self._durable:
            await self._msg.nak(delay=delay)

    async def term(self) -> None:
        if self._durable:
            await self._msg.term()

    async def in_progress(self) -> None:
        if self._durable:
            await self._msg.in_progress()


class _NatsLease(Message):
    """A durable message known only by its ack token (the JetStream reply subject)."""

    def __init__(self, nc: Client, token: str) -> None:
        if not token.startswith("$JS.ACK."):
            raise BusError(f"not a JetStream ack token: {token!r}")
        self._nc = nc
        self.ack_token = token
        self.subject = ""
        self.data = b""
        self.headers = {}
        self.num_delivered = 0
        self.stream_seq = 0

    async def ack(self, *, wait: bool = False) -> None:
        await self._nc.request(self.ack_token, b"+ACK", timeout=5.0)

    async def nak(self, delay: float | None = None) -> None:
        await self._nc.publish(self.ack_token, b"-NAK")

    async def term(self) -> None:
        await self._nc.publish(self.ack_token, b"+TERM")

    async def in_progress(self) -> None:
        await self._nc.publish(self.ack_token, b"+WPI")


class _NatsConsumer(Consumer):
    def __init__(
        self,
        spec: ConsumerSpec,
        sub: JetStreamContext.PullSubscription,
        nc: Client,
        outage: Outage,
    ) -> None:
        self.spec = spec
        self._sub = sub
        self._nc = nc
        self._outage = outage

    async def fetch(self, batch: int = 1, timeout: float = 1.0) -> list[Message]:
        try:
            msgs = await self._sub.fetch(batch, timeout=max(timeout, 0.01))
        except TimeoutError:  # nats.errors.TimeoutError, or the builtin from some fetch paths
            return []  # nothing to fetch (or no server: the other calls tell)
        except TRANSIENT as exc:
            await self._outage.wait("fetch", exc, min(timeout, 1.0))
            return []
        return [_NatsMessage(m, durable=True) for m in msgs]

    async def release_buffered(self) -> int:
        # nats-py keeps what pull requests delivered after their fetch returned in the
        # subscription's pending queue (its fetch drains that queue first, see _fetch_n).
        inner = self._sub._sub
        released = 0
        while not inner._pending_queue.empty():
            msg = inner._pending_queue.get_nowait()
            inner._pending_size -= len(msg.data)
            if JetStreamContext.is_status_msg(msg):
                continue  # a status reply to an expired pull request, not a message
            await msg.nak()
            released += 1
        return released

    async def state(self) -> ConsumerState:
        async def ask() -> api.ConsumerInfo:
            await self._nc.flush()  # let the server see our acks sent so far
            return await self._sub.consumer_info()

        info = await self._outage.call("consumer info", ask)
        return ConsumerState(
            pending=info.num_pending or 0,
            ack_pending=info.num_ack_pending or 0,
            redelivered=info.num_redelivered or 0,
        )

    async def close(self) -> None:
        with contextlib.suppress(nats.errors.BadSubscriptionError):
            await self._sub.unsubscribe()


class _NatsSubscription(Subscription):
    def __init__(self, sub: nats.aio.subscription.Subscription) -> None:
        self._sub = sub

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Message]:
        async for msg in self._sub.messages:
            yield _NatsMessage(msg, durable=False)

    async def unsubscribe(self) -> None:
        with contextlib.suppress(nats.errors.BadSubscriptionError):
            await self._sub.unsubscribe()


class _Refused(nats.errors.Error):
    """The server refused our login, or its TLS certificate failed verification, while
    connecting: retrying cannot help (nats-py would retry, or hang after a TLS error)."""


class NatsBus(Bus):
    """JetStream-backed bus; ``url`` of a running nats-server with JetStream enabled."""

    def __init__(
        self,
        subjects: Subjects,
        url: str,
        streams: tuple[StreamSpec, ...] | None = None,
        *,
        create_streams: bool = True,
        reconnect_attempts: int = -1,
        outage_s: float | None = None,
        auth: NatsAuth | None = None,
    ) -> None:
        """``create_streams=False`` for observers (``dora tail``) of a run started elsewhere:
        they must not create or reconfigure its streams. ``reconnect_attempts`` (-1: forever,
        every 0.2 s) bounds how long a client waits for a server that went away before its
        calls fail with ``nats.errors.ConnectionClosedError``. ``outage_s`` (default
        ``DORA_NATS_OUTAGE_S`` or 120): how long calls retry a server that is away before they
        raise ``BusUnavailable`` (``dora.bus.outage``). ``auth``: credentials and TLS CA
        (``dora.bus.auth``); a ``tls://`` URL always connects over verified TLS."""
        super().__init__(subjects, streams)
        self.url = url
        self.create_streams = create_streams
        self.reconnect_attempts = reconnect_attempts
        self.auth = auth or NatsAuth()
        self.permission_denied: str | None = None
        """The server's last permissions violation for this client (it drops what it refuses
        and tells only this callback; the refused call itself just times out)."""
        self.outage = Outage(url, outage_s_from_env() if outage_s is None else outage_s)
        self._error_reported = False
        self._nc: Client | None = None
        self._closing = False
        self._js: JetStreamContext | None = None
        self._objects: ObjectStore | None = None
        self._kv: KeyValue | None = None
        self._readers: list[Callable[[], Awaitable[None]]] = []
        self._stream_names = {s.family: subjects.stream(s.family) for s in self.streams}

    @property
    def nc(self) -> Client:
        if self._nc is None:
            raise BusError("bus is not connected")
        return self._nc

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            raise BusError("bus is not connected")
        return self._js

    async def connect(self) -> None:
        self._closing = False
        await reachable(self.url)
        try:
            self._nc = await self._open_connection()
        except _Refused as exc:
            raise BusError(str(exc)) from exc
        if tls_options(self.url) and not self._nc._server_info.get("tls_required"):
            # nats-py upgrades to TLS only when the server requires it: refuse plain text
            await self._nc.close()
            raise BusError(f"{self.url} asks for TLS but the server there does not offer it")
        self._js = self._nc.jetstream(timeout=10.0)
        if self.create_streams:
            try:
                for spec in self.streams:
                    await self._ensure_stream(spec)
            except TimeoutError as exc:
                if self.permission_denied is None:
                    raise
                raise BusError(
                    f"the NATS user at {self.url} lacks a permission dora needs "
                    f"({self.permission_denied}); {required_permissions(self.subjects)}"
                ) from exc

    async def _open_connection(self) -> Client:
        return await nats.connect(
            servers=[self.url],
            max_reconnect_attempts=self.reconnect_attempts,
            reconnect_time_wait=0.2,
            name="dora",
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
            **self.auth.connect_options(self.url),
        )

    # one line per outage instead of nats-py's traceback per reconnect attempt (5 a second)
    async def _on_error(self, exc: Exception) -> None:
        error = f"{type(exc).__name__}: {exc}"
        if self._nc is None:  # still connecting: leave nats-py's loop on what retries cannot fix
            if "authorization violation" in error.lower():
                who = f"user {self.auth.user!r}" if self.auth.user else "an anonymous client"
                raise _Refused(
                    f"the NATS server at {self.url} refused the login of {who} (wrong or "
                    "missing credentials: a run's embedded server admits only the logins in "
                    "its folder's credentials/)"
                ) from exc
            if isinstance(exc, ssl.SSLError):
                raise _Refused(
                    f"TLS with {self.url} failed: {exc} (a private CA: --nats-ca / "
                    "NatsAuth.ca_file)"
                ) from exc
        if "permissions violation" in str(exc).lower():
            self.permission_denied = str(exc).removeprefix("nats: ")
            log.error("nats refused an operation", url=self.url, error=self.permission_denied)
            return
        if self._closing or self._error_reported:
            log.debug("nats connection error", url=self.url, error=error)
            return
        self._error_reported = True
        log.warning("nats connection error", url=self.url, error=error)

    async def _on_disconnected(self) -> None:
        if self._closing:  # our own close(): expected, not worth a warning
            log.debug("nats disconnected", url=self.url)
            return
        self.outage.begin()
        log.warning(
            "nats disconnected; reconnecting", url=self.url, rides_out_s=self.outage.outage_s
        )

    async def _on_reconnected(self) -> None:
        self._error_reported = False
        log.info("nats reconnected", url=self.url)

    async def _ensure_stream(self, spec: StreamSpec) -> None:
        family = f"{self.subjects.root}.{spec.family}"
        config = api.StreamConfig(
            name=self._stream_names[spec.family],
            subjects=[family, f"{family}.>"],
            retention=_RETENTION[spec.retention],
            max_msgs=spec.max_msgs,
            max_bytes=spec.max_bytes,
            discard=api.DiscardPolicy.NEW if spec.blocks_when_full else api.DiscardPolicy.OLD,
            storage=api.StorageType.FILE,
            duplicate_window=spec.duplicate_window_s,
            max_age=spec.max_age_s or None,
        )
        try:
            await self.js.add_stream(config)
        except nats.js.errors.BadRequestError:
            await self.js.update_stream(config)

    async def close(self) -> None:
        # Pull and live subscriptions may hold messages nobody will read (late deliveries,
        # fetch status replies); draining would wait for them until drain_timeout. Drop those
        # first (unacked ones are redelivered), then drain so running rpc handlers can reply.
        self._closing = True
        for stop in self._readers:
            with contextlib.suppress(nats.errors.Error):
                await stop()
        self._readers.clear()
        if self._nc is not None and not self._nc.is_closed:
            if self._nc.is_connected:
                await self._nc.drain()
            else:  # the server is away: nothing can be drained, close at once
                await self._nc.close()
        self._nc = self._js = None
        self._objects = self._kv = None

    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        msg_id: str | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> PublishResult | None:
        if not self.is_durable(subject):
            await self.nc.publish(subject, data, headers=headers)
            return None
        hdrs = dict(headers or {})
        if msg_id is not None:
            hdrs["Nats-Msg-Id"] = msg_id
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        delay = 0.001
        while True:
            try:
                ack = await self.js.publish(subject, data, headers=hdrs or None)
                if self.outage.since is not None:
                    self.outage.end()
                return PublishResult(ack.stream, ack.seq, duplicate=bool(ack.duplicate))
            except (*TRANSIENT, nats.js.errors.APIError) as exc:
                full = isinstance(exc, nats.js.errors.APIError) and exc.err_code in _FULL_CODES
                if not full:
                    if msg_id is None or not isinstance(exc, TRANSIENT):
                        raise
                    # the server is away: safe to retry, it deduplicates by msg id
                    await self.outage.wait(f"publish on {subject}", exc, delay)
                    delay = min(delay * 2, 1.0)
                    continue
            if deadline is not None and loop.time() >= deadline:
                raise PublishTimeout(f"{subject}: stream stayed full for {timeout}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, _BACKOFF_MAX_S)

    async def consumer(self, spec: ConsumerSpec) -> Consumer:
        stream = self._stream_name(spec.filter_subject)
        config = api.ConsumerConfig(
            durable_name=spec.durable,
            filter_subject=spec.filter_subject,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=spec.ack_wait_s,
            max_deliver=spec.max_deliver,
            max_ack_pending=spec.max_ack_pending,
            max_waiting=512,
        )
        sub = await self.outage.call(
            f"consumer {spec.durable} on {spec.filter_subject}",
            lambda: self.js.pull_subscribe(
                spec.filter_subject, durable=spec.durable, stream=stream, config=config
            ),
        )
        consumer = _NatsConsumer(spec, sub, self.nc, self.outage)
        self._readers.append(consumer.close)
        return consumer

    async def delete_consumer(self, subject: str, durable: str) -> None:
        stream = self._stream_name(subject)
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.outage.call(
                "delete consumer", lambda: self.js.delete_consumer(stream, durable)
            )

    async def subscribe(self, subject: str) -> Subscription:
        sub = _NatsSubscription(await self.nc.subscribe(subject, pending_msgs_limit=65_536))
        self._readers.append(sub.unsubscribe)
        await self._server_has_seen_our_commands()
        return sub

    async def _server_has_seen_our_commands(self) -> None:
        """Return once the server has processed every command sent so far (a new SUB above
        all), so a client on another connection is routed to it at once.

        One ``flush()`` is not enough: nats-py writes its PING straight to the socket, ahead
        of the SUB still waiting for the flusher task, and the PONG can come back before the
        server saw the SUB (12% of 1,000 subscribe-then-publish rounds lost the message).
        The first flush wakes the flusher, which writes the SUB before that PONG is read; the
        second PING therefore follows the SUB (0 of 1,000 lost).
        """
        await self.nc.flush()
        await self.nc.flush()

    def _stream_name(self, subject: str) -> str:
        name = self._stream_names.get(self.subjects.family_of(subject))
        if name is None:
            raise BusError(f"subject {subject!r} belongs to no durable stream")
        return name

    async def stream_info(self, subject: str) -> StreamState:
        name = self._stream_name(subject)
        info = await self.outage.call("stream info", lambda: self.js.stream_info(name))
        state = info.state
        return StreamState(
            stream=info.config.name or "",
            messages=state.messages,
            bytes=state.bytes,
            first_seq=state.first_seq,
            last_seq=state.last_seq,
            consumers=state.consumer_count,
        )

    async def stored_by_subject(self, subject: str) -> dict[str, int]:
        name = self._stream_name(subject)
        info = await self.outage.call(
            "stream info", lambda: self.js.stream_info(name, subjects_filter=">")
        )
        return {str(k): int(v) for k, v in (info.state.subjects or {}).items()}

    async def stream_messages(
        self,
        subject: str,
        *,
        start: StartAt = "first",
        follow: bool = False,
        poll_s: float = 0.2,
    ) -> AsyncIterator[StoredMessage]:
        # Direct reads of the stream (STREAM.MSG.GET next_by_subj): unlike a consumer, they
        # neither count as interest nor compete for work-queue messages.
        stream = self._stream_name(subject)
        if start == "new":
            seq = (await self.stream_info(subject)).last_seq + 1
        else:
            seq = 1 if start == "first" else max(int(start), 1)
        while True:
            try:
                raw = await self.outage.call(
                    "stream read",
                    lambda: self.js.get_msg(stream, seq, subject=subject, next=True),  # noqa: B023
                )
            except nats.js.errors.NotFoundError:
                if not follow:
                    return
                await asyncio.sleep(poll_s)
                continue
            seq = (raw.seq or seq) + 1
            headers = {k: str(v) for k, v in (raw.headers or {}).items()}
            yield StoredMessage(raw.subject or "", raw.data or b"", headers, raw.seq or 0)

    async def request(self, subject: str, data: bytes, timeout: float = 5.0) -> bytes:
        try:
            msg = await self.nc.request(subject, data, timeout=timeout)
        except nats.errors.NoRespondersError as exc:
            raise NoResponders(f"no service answers {subject!r}") from exc
        except nats.errors.TimeoutError as exc:
            raise RequestTimeout(f"no reply on {subject!r} within {timeout}s") from exc
        return msg.data

    async def serve(self, subject: str, handler: Handler) -> Subscription:
        async def respond(msg: Msg) -> None:
            try:
                reply = await handler(msg.data)
            except Exception:
                log.exception("rpc handler failed", subject=subject)
                return
            await msg.respond(reply)

        sub = await self.nc.subscribe(subject, queue="dora-rpc", cb=respond)
        await self._server_has_seen_our_commands()
        return _NatsSubscription(sub)

    async def _object_store(self) -> ObjectStore:
        if self._objects is None:
            bucket = self.subjects.blob_bucket

            async def open_store() -> ObjectStore:
                try:
                    return await self.js.object_store(bucket)
                except nats.js.errors.BucketNotFoundError:
                    return await self.js.create_object_store(bucket)

            self._objects = await self.outage.call("object store", open_store)
        return self._objects

    async def put_blob(self, name: str, data: bytes) -> BlobRef:
        store = await self._object_store()
        await self.outage.call(f"blob put {name}", lambda: store.put(name, data))
        digest = hashlib.sha256(data).hexdigest()
        return BlobRef(bucket=self.subjects.blob_bucket, name=name, size=len(data), sha256=digest)

    async def get_blob(self, name: str) -> bytes:
        store = await self._object_store()

        async def read() -> bytes:
            buffer = io.BytesIO()  # nats-py's default `data += chunk` is quadratic in the size
            await store.get(name, writeinto=buffer)
            return buffer.getvalue()

        try:
            return await self.outage.call(f"blob get {name}", read)
        except nats.js.errors.ObjectNotFoundError as exc:
            raise BlobNotFound(name) from exc

    async def delete_blob(self, name: str) -> None:
        store = await self._object_store()
        with contextlib.suppress(nats.js.errors.ObjectNotFoundError):
            await self.outage.call(f"blob delete {name}", lambda: store.delete(name))
        # nats-py's delete leaves a "deleted" marker as the object's meta message; each marker
        # pins a whole message block of the file store, so a run that replaces its weights every
        # step kept every version on disk (550 MB of 47 MB live in the demo). Purging the
        # marker's subject lets the server drop the emptied blocks.
        bucket = self.subjects.blob_bucket
        meta = f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.outage.call(
                "blob purge", lambda: self.js.purge_stream(f"OBJ_{bucket}", subject=meta)
            )

    def lease(self, ack_token: str) -> Message:
        return _NatsLease(self.nc, ack_token)

    async def _kv_bucket(self) -> KeyValue:
        if self._kv is None:
            bucket = self.subjects.kv_bucket

            async def open_bucket() -> KeyValue:
                try:
                    return await self.js.key_value(bucket)
                except nats.js.errors.BucketNotFoundError:
                    return await self.js.create_key_value(bucket=bucket)

            self._kv = await self.outage.call("kv bucket", open_bucket)
        return self._kv

    async def kv_put(self, key: str, value: bytes) -> int:
        bucket = await self._kv_bucket()
        return await self.outage.call(f"kv put {key}", lambda: bucket.put(key, value))

    async def kv_get(self, key: str) -> bytes | None:
        bucket = await self._kv_bucket()
        try:
            entry = await self.outage.call(f"kv get {key}", lambda: bucket.get(key))
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value

    async def kv_delete(self, key: str) -> None:
        bucket = await self._kv_bucket()
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            await self.outage.call(f"kv delete {key}", lambda: bucket.delete(key))


async def reachable(url: str, within_s: float = 5.0) -> None:
    """Fail fast, with the real cause, when nothing accepts TCP connections at ``url``.

    nats-py retries an unreachable server as it would a lost one (a warning per attempt,
    then a bare ``TimeoutError``). A refused or unresolvable address is retried for
    ``within_s`` (a server may be starting) and then raised as ``ConnectionError`` naming it.
    """
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    host, port = parts.hostname or "127.0.0.1", parts.port or 4222
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), within_s)
        except (OSError, TimeoutError) as exc:
            if loop.time() >= deadline:
                cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                msg = f"nothing accepts connections at {host}:{port} ({cause})"
                raise ConnectionError(msg) from exc
            await asyncio.sleep(0.25)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return
