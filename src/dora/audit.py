"""The run recorder: every event of a run, one JSON line each, in ``<run_dir>/events/``.

Why a recorder and not just the streams: streams are trimmed (work and interest retention
delete what was consumed) and live subjects (engine status) are never stored, yet a report
after the run needs all of it. The recorder is one more durable consumer (``recorder``) on the
durable families, plus a live subscription to ``status.*``; it appends each payload that is a
valid event of its family to ``events/<family>.jsonl`` (anything else, and an event naming a
version never published or a second result of one request (``dora.reference_check``), goes
to ``events/rejected.jsonl`` with the reason) and acks only what it has written. A crash means
redelivery of what it had not acked: it skips an event id it wrote within the last ack window
(seeded from the file's tail on restart), and on stop it waits (up to ``drain_timeout_s``) for
messages still owed to it by a crashed predecessor, so a resumed run's record holds every event
once.

It must never slow the pipeline: each family holds at most one fetched batch in memory (the
consumer's ``max_ack_pending`` bounds the rest on the server), status is thinned per engine
and dropped (counted) rather than queued when the writer falls behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import structlog

from dora.bus.base import Bus, Consumer, ConsumerSpec, Message, Subscription
from dora.contract import FAMILY_EVENTS
from dora.events import EngineStatus, Event, Ledger
from dora.reference_check import ReferenceCheck
from dora.stage.deadletter import dead_letter, parse_event
from dora.stage.pull import Puller
from dora.subjects import LEDGER_KEY

log = structlog.get_logger(__name__)

RECORDED_FAMILIES: tuple[str, ...] = (
    "trajectories",
    "scored",
    "migrations",
    "metrics",
    "weights",
    "deadletter",
)
"""Durable families the recorder keeps (prompts and requests are work queues: not audited)."""

EVENTS_DIR = "events"
STATUS_FILE = "status"
LEDGER_FILE = "ledger"
REJECTED_FILE = "rejected"
STEM_MODEL: dict[str, type[Event]] = {
    **FAMILY_EVENTS,
    STATUS_FILE: EngineStatus,
    LEDGER_FILE: Ledger,
}
"""The event type every line of ``events/<stem>.jsonl`` is."""
"""The family whose event type a recorded file holds, where the file is not named after it."""
ACK_WAIT_S = 5.0
"""A batch is written and acked in milliseconds; a crashed recorder's batch returns this soon."""


@dataclass
class RecorderStats:
    """What the recorder wrote, per file stem, and what it could not keep."""

    written: dict[str, int] = field(default_factory=dict)
    rejected: int = 0
    redelivered: int = 0
    status_thinned: int = 0
    status_dropped: int = 0


RECORDER_ONLY = ("migrations", "deadletter")
"""Families no other stage reads: the recorder dead-letters what it refuses there (elsewhere
the consuming stage does, and one bad message leaves one dead letter)."""

REJECTED_PAYLOAD_MAX = 4096
"""Bytes of a rejected payload kept in ``rejected.jsonl`` (its size is recorded in full)."""


def _as_line(stem: str, data: bytes) -> tuple[bytes | None, str, Event | None]:
    """The payload as one JSON line if it is a valid event for ``events/<stem>.jsonl``, else
    the reason.

    The event is validated by the model an outside reader would use (``dora.contract``), so
    a forged or malformed message (invalid UTF-8, wrong types, a deeply nested array) never
    reaches ``events/`` where every JSON tool would have to cope with it. pydantic-core
    validates in Rust: ~80 us for a 1,000-token trajectory (20 kB), half of ``json.loads``.
    """
    model = STEM_MODEL.get(stem)
    if model is None:
        return None, f"no event type for {stem!r}", None
    event, reason = parse_event(model, data)
    if event is None:
        return None, reason, None
    body = data.strip()
    if b"\n" in body or b"\r" in body:  # pretty-printed: one line per event
        body = event.model_dump_json().encode()
    return body, "", event


def _tail_ids(path: Path, count: int) -> OrderedDict[str, None]:
    """Event ids of the last ``count`` lines of a recorded file (empty when there is none)."""
    ids: OrderedDict[str, None] = OrderedDict()
    if not path.exists():
        return ids
    with path.open("rb") as fh:
        for line in deque(fh, maxlen=count):
            with contextlib.suppress(ValueError, AttributeError):
                event_id = json.loads(line).get("event_id")
                if isinstance(event_id, str):
                    ids[event_id] = None
    return ids


class RunRecorder:
    """Appends the events of one run to ``run_dir/events/<family>.jsonl``.

    ``async with RunRecorder(bus, run_dir):`` records while the block runs; or ``await run()``
    (records until ``stop()``). ``stop()`` drains what the streams still hold for it (up to
    ``drain_timeout_s``), writes, acks and closes the files.
    """

    def __init__(
        self,
        bus: Bus,
        run_dir: Path | str,
        *,
        families: tuple[str, ...] = RECORDED_FAMILIES,
        status: bool = True,
        ledger: bool = True,
        durable: str = "recorder",
        batch: int = 256,
        status_interval_s: float = 0.5,
        status_queue: int = 4096,
        flush_interval_s: float = 0.5,
        ledger_poll_s: float = 1.0,
        drain_timeout_s: float = 10.0,
        delete_consumers_on_stop: bool = False,
    ) -> None:
        self.bus = bus
        self.dir = Path(run_dir) / EVENTS_DIR
        self.families = tuple(f for f in families if bus.is_durable(self._subject(f)))
        self.record_status = status
        self.record_ledger = ledger
        self.durable = durable
        self.batch = batch
        self.status_interval_s = status_interval_s
        self.flush_interval_s = flush_interval_s
        self.ledger_poll_s = ledger_poll_s
        self.drain_timeout_s = drain_timeout_s
        self.delete_consumers_on_stop = delete_consumers_on_stop
        self.stats = RecorderStats()
        self._files: dict[str, IO[bytes]] = {}
        self._status_q: asyncio.Queue[Message] = asyncio.Queue(maxsize=status_queue)
        self._status_last: dict[str, tuple[float, tuple[Any, ...]]] = {}
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._consumers: list[Consumer] = []
        self._subscription: Subscription | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._started = False
        self._window = max(self.batch * 4, 1024)  # the consumer's max_ack_pending
        self._recent: dict[str, OrderedDict[str, None]] = {}
        self._references = ReferenceCheck(bus)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Create the consumers and subscription, then record in background tasks."""
        if self._started:
            return
        self._started = True
        self.dir.mkdir(parents=True, exist_ok=True)
        for family in self.families:
            self._recent[family] = _tail_ids(self.dir / f"{family}.jsonl", self._window)
            spec = ConsumerSpec(
                self.durable,
                self._subject(family),
                max_ack_pending=self._window,
                ack_wait_s=ACK_WAIT_S,
            )
            consumer = await self.bus.consumer(spec)
            self._consumers.append(consumer)
            self._spawn(self._record_family(family, consumer), f"recorder-{family}")
        if self.record_status:
            self._subscription = await self.bus.subscribe(self.bus.subjects.status_all)
            self._receiver = self._spawn(
                self._receive_status(self._subscription), "recorder-status-in"
            )
            self._spawn(self._write_status(), "recorder-status-out")
        if self.record_ledger:
            self._spawn(self._poll_ledger(), "recorder-ledger")
        log.info("recorder_started", dir=str(self.dir), families=self.families)

    def _subject(self, family: str) -> str:
        return f"{self.bus.subjects.root}.{family}"

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        return task

    async def run(self) -> None:
        """Record until ``stop()`` is called (from another task)."""
        await self.start()
        await self._stopping.wait()

    async def stop(self) -> RecorderStats:
        """Drain the durable families, write what is pending, ack it, close the files."""
        self._stopping.set()
        if self._subscription is not None:
            await self._subscription.unsubscribe()
        if self._receiver is not None:
            self._receiver.cancel()  # a live iterator need not end on unsubscribe
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        for task, result in zip(self._tasks, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                log.error("recorder_task_failed", task=task.get_name(), error=repr(result))
        self._tasks.clear()
        for consumer in self._consumers:
            await consumer.close()
        if self.delete_consumers_on_stop:
            for family in self.families:
                await self.bus.delete_consumer(self._subject(family), self.durable)
        self._consumers.clear()
        for fh in self._files.values():
            fh.flush()
            fh.close()
        self._files.clear()
        log.info(
            "recorder_stopped",
            written=self.stats.written,
            rejected=self.stats.rejected,
            status_dropped=self.stats.status_dropped,
        )
        return self.stats

    async def __aenter__(self) -> RunRecorder:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ writing

    def _file(self, stem: str) -> IO[bytes]:
        fh = self._files.get(stem)
        if fh is None:
            fh = (self.dir / f"{stem}.jsonl").open("ab")
            self._files[stem] = fh
        return fh

    def _seen(self, stem: str, msg: Message) -> bool:
        """True for an event id written within the last ack window (a redelivery)."""
        recent = self._recent.get(stem)
        if recent is None or not msg.msg_id:
            return False
        if msg.msg_id in recent:
            return True
        recent[msg.msg_id] = None
        if len(recent) > self._window:
            recent.popitem(last=False)
        return False

    async def _write(self, stem: str, msg: Message) -> str:
        """Write ``msg`` to its file, or to ``rejected.jsonl`` and return the reason."""
        if self._seen(stem, msg):
            self.stats.redelivered += 1
            return ""
        line, reason, event = _as_line(stem, msg.data)
        if event is not None and stem != STATUS_FILE:
            reason = await self._references.refusal(stem, event)
            line = None if reason else line
        if line is None:
            self.stats.rejected += 1
            log.warning("recorder_rejected", subject=msg.subject, reason=reason[:300])
            record = {
                "subject": msg.subject,
                "reason": reason,
                "size": len(msg.data),
                "payload": msg.data[:REJECTED_PAYLOAD_MAX].decode("utf-8", errors="replace"),
            }
            self._file(REJECTED_FILE).write(json.dumps(record).encode() + b"\n")
            return reason
        self._file(stem).write(line + b"\n")
        self.stats.written[stem] = self.stats.written.get(stem, 0) + 1
        return ""

    def _flush(self, *stems: str) -> None:
        for stem in (*stems, REJECTED_FILE):
            fh = self._files.get(stem)
            if fh is not None:
                fh.flush()

    async def _record_family(self, family: str, consumer: Consumer) -> None:
        """Fetch a batch, write it, flush, ack it; on stop, fetch until the stream is empty
        and nothing delivered to a crashed predecessor is still owed."""
        deadline: float | None = None
        puller = Puller(consumer, "recorder")
        while True:
            if self._stopping.is_set() and deadline is None:
                deadline = time.monotonic() + self.drain_timeout_s
            timeout = 0.2 if deadline is not None else self.flush_interval_s
            msgs = await puller.fetch(self.batch, timeout)
            refused = [(msg, reason) for msg in msgs if (reason := await self._write(family, msg))]
            self._flush(family)
            lettered = set()
            if family in RECORDER_ONLY:  # no other stage reads it, so none dead-letters it
                for msg, reason in refused:
                    await dead_letter(self.bus, msg, "recorder", reason)
                    lettered.add(id(msg))
            for msg in msgs:
                if id(msg) not in lettered:
                    await msg.ack()
            if deadline is None:
                continue
            if not msgs and not await self._owed(consumer):
                return  # drained
            if time.monotonic() >= deadline:
                log.warning("recorder_drain_timeout", family=family)
                return

    async def _owed(self, consumer: Consumer) -> bool:
        """Messages delivered but never acked (a crashed recorder's): they come back within
        ``ACK_WAIT_S``, so the drain waits for them."""
        with contextlib.suppress(Exception):
            state = await consumer.state()
            return state.pending > 0 or state.ack_pending > 0
        return False

    # ------------------------------------------------------------------ status

    async def _receive_status(self, sub: Subscription) -> None:
        async for msg in sub:
            try:
                self._status_q.put_nowait(msg)
            except asyncio.QueueFull:
                self.stats.status_dropped += 1

    def _keep_status(self, msg: Message, now: float) -> bool:
        """One per engine per interval, but always a change of version, assignment or state."""
        try:
            obj = json.loads(msg.data)
            engine = str(obj["engine_id"])
            key = (obj.get("version"), obj.get("assigned_version"), obj.get("state"))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return True  # let _write reject it with its reason
        last = self._status_last.get(engine)
        if last is not None and last[1] == key and now - last[0] < self.status_interval_s:
            return False
        self._status_last[engine] = (now, key)
        return True

    async def _write_status(self) -> None:
        last_flush = time.monotonic()
        while not (self._stopping.is_set() and self._status_q.empty()):
            with contextlib.suppress(TimeoutError):
                msg = await asyncio.wait_for(self._status_q.get(), self.flush_interval_s)
                if self._keep_status(msg, time.monotonic()):
                    await self._write(STATUS_FILE, msg)
                else:
                    self.stats.status_thinned += 1
            if time.monotonic() - last_flush >= self.flush_interval_s:
                self._flush(STATUS_FILE)
                last_flush = time.monotonic()
        self._flush(STATUS_FILE)

    # ------------------------------------------------------------------ ledger

    async def _poll_ledger(self) -> None:
        """Snapshot the dispatcher's ledger (KV store) whenever it changed."""
        last: bytes | None = None
        while True:
            try:
                raw = await self.bus.kv_get(LEDGER_KEY)
            except Exception as exc:  # a missing bucket must not stop recording
                log.debug("recorder_ledger_unreadable", error=repr(exc))
                raw = None
            if raw is not None and raw != last:
                last = raw
                line, reason, _ = _as_line(LEDGER_FILE, raw)
                if line is None:
                    log.warning("recorder_ledger_rejected", reason=reason)
                else:
                    self._file(LEDGER_FILE).write(line + b"\n")
                    self._file(LEDGER_FILE).flush()
                    self.stats.written[LEDGER_FILE] = self.stats.written.get(LEDGER_FILE, 0) + 1
            if self._stopping.is_set():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.ledger_poll_s)
