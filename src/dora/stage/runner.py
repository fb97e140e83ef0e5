"""The runtime of one stage: pull, validate, handle, publish, ack; retry; dead-letter; drain.

Guarantees (what the tests check):

- the ack comes only after the handler returned and every event it emitted is stored;
- a payload that does not validate, a ``Reject`` from the handler, or a handler that still
  fails on its last allowed delivery becomes a ``DeadLetter`` (published *before* the
  message is termed) - never a silent drop;
- a failing handler is retried by nak with exponential backoff;
- ``stop`` stops pulling, lets in-flight events finish (``drain_timeout``), naks the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

import structlog
from pydantic import ValidationError

from dora.bus import Bus, Consumer, ConsumerSpec, Message
from dora.events import Event
from dora.stage.base import Emitted, Reject, Stage, StageError, resolve_subject
from dora.stage.context import Context
from dora.stage.deadletter import dead_letter, validation_reason
from dora.stage.pull import Puller

log = structlog.get_logger(__name__)

CRASH_SLACK = 3
"""Deliveries the consumer allows beyond ``RetryPolicy.max_deliver`` (see ``consumer_spec``)."""


def iter_emitted(result: Emitted) -> Iterable[Event]:
    if result is None:
        return ()
    if isinstance(result, Event):
        return (result,)
    return result


class StageRunner:
    """Runs ``replicas`` pull loops (or one source loop) of a stage on a bus."""

    def __init__(
        self,
        stage: Stage,
        bus: Bus,
        replicas: int = 1,
        *,
        fetch_timeout: float = 0.25,
        drain_timeout: float = 30.0,
    ) -> None:
        if replicas < 1:
            raise StageError(f"stage {stage.name}: replicas must be >= 1")
        if stage.is_source and replicas != 1 and not stage.hosts_replicas:
            raise StageError(f"stage {stage.name}: a source runs as exactly one replica")
        self.stage = stage
        self.bus = bus
        self.replicas = replicas
        self.fetch_timeout = fetch_timeout
        self.drain_timeout = drain_timeout
        self.ctx = Context(stage, bus)
        self.stats = self.ctx.stats
        self._consumers: list[Consumer] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._set_up = False

    @property
    def subject(self) -> str | None:
        ref = self.stage.consumes
        return None if ref is None else resolve_subject(self.bus.subjects, ref)

    def consumer_spec(self) -> ConsumerSpec:
        assert self.subject is not None
        retry = self.stage.retry
        return ConsumerSpec(
            durable=self.stage.name,
            filter_subject=self.subject,
            max_ack_pending=self.stage.concurrency * self.replicas,
            # a few spare deliveries: a message whose last attempt died with its process comes
            # back once more and is dead-lettered then, instead of being dropped by the server
            max_deliver=retry.max_deliver + CRASH_SLACK,
            ack_wait_s=retry.ack_wait_s,
        )

    async def prepare(self) -> None:
        """Create the durable consumer now, so no event published later is missed."""
        if self.stage.is_processor and not self._consumers:
            spec = self.consumer_spec()
            if not self.bus.is_durable(spec.filter_subject):
                raise StageError(f"stage {self.stage.name}: {spec.filter_subject} is not durable")
            for _ in range(self.replicas):
                self._consumers.append(await self.bus.consumer(spec))

    async def start(self) -> None:
        await self.prepare()
        await self.stage.setup(self.ctx)
        self._set_up = True
        if self.stage.is_source:
            self._tasks.append(asyncio.create_task(self._source_loop(), name=self.stage.name))
        else:
            for i, consumer in enumerate(self._consumers):
                task = asyncio.create_task(self._pull_loop(consumer), name=f"{self.stage.name}.{i}")
                self._tasks.append(task)

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        return self._tasks

    async def stop(self) -> None:
        """Stop pulling, drain in-flight work, close consumers, call ``teardown``."""
        self._stopping.set()
        for task in self._tasks:
            if self.stage.is_source:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for consumer in self._consumers:
            with contextlib.suppress(Exception):
                await consumer.close()
        if self._set_up:
            self._set_up = False
            await self.stage.teardown(self.ctx)

    # ----------------------------------------------------------------- loops

    async def _source_loop(self) -> None:
        with structlog.contextvars.bound_contextvars(run=self.ctx.run_id, stage=self.stage.name):
            async for event in self.stage.produce(self.ctx):
                if self._stopping.is_set():
                    # stop() cancels this task, but on Python 3.11 a cancel that arrives as a
                    # publish's ack does is swallowed (asyncio.wait_for in nats-py): a source
                    # publishing into a busy stream would go on until killed
                    return
                await self.ctx.publish(event)
                self.stats.processed += 1
        self.ctx.complete()
        self.ctx.log.info("source exhausted", produced=self.stats.processed)

    async def _pull_loop(self, consumer: Consumer) -> None:
        inflight: set[asyncio.Task[None]] = set()
        puller = Puller(consumer, self.stage.name)
        while not self._stopping.is_set():
            free = self.stage.concurrency - len(inflight)
            if free <= 0:
                stopping = asyncio.create_task(self._stopping.wait())
                await asyncio.wait({*inflight, stopping}, return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                continue
            for msg in await puller.fetch(free, self.fetch_timeout):
                task = asyncio.create_task(self._process(msg))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
        if inflight:
            _, pending = await asyncio.wait(inflight, timeout=self.drain_timeout)
            for task in pending:
                task.cancel()  # _process naks on cancel
            await asyncio.gather(*pending, return_exceptions=True)

    # ----------------------------------------------------------------- one message

    async def _process(self, msg: Message) -> None:
        self.stats.received += 1
        self.stats.in_flight += 1
        try:
            with structlog.contextvars.bound_contextvars(
                run=self.ctx.run_id, stage=self.stage.name, subject=msg.subject
            ):
                await self._process_bound(msg)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(msg.nak())
            raise
        finally:
            self.stats.in_flight -= 1

    async def _process_bound(self, msg: Message) -> None:
        model = self.stage.input_model
        assert model is not None
        limit = self.stage.retry.max_deliver
        if msg.num_delivered > limit:
            reason = (
                f"delivered {msg.num_delivered} times (limit {limit}) without being settled: "
                "the stage crashed or ran past its ack wait on it each time"
            )
            await self._dead_letter(msg, reason)
            return
        try:
            event = model.model_validate_json(msg.data)
        except ValidationError as exc:
            await self._dead_letter(msg, validation_reason(model, exc))
            return
        with structlog.contextvars.bound_contextvars(event_id=event.event_id):
            mctx = self.ctx.for_message(msg.subject, msg.num_delivered, event.event_id)
            heartbeat = asyncio.create_task(self._heartbeat(msg))
            try:
                for out in iter_emitted(await self.stage.handle(event, mctx)):
                    await mctx.publish(out)
                if mctx.held is not None:  # settled later by the stage (its slot stays taken)
                    stopping = asyncio.create_task(self._stopping.wait())
                    await asyncio.wait(
                        {mctx.held.outcome, stopping}, return_when=asyncio.FIRST_COMPLETED
                    )
                    stopping.cancel()
                    if not mctx.held.outcome.done():  # stopping: hand it back, unsettled
                        await msg.nak()
                        return
                    verdict, why = mctx.held.outcome.result()
                    if verdict == "nak":
                        self.stats.retried += 1
                        await msg.nak(delay=self.stage.retry.delay(msg.num_delivered))
                        return
                    if verdict == "reject":
                        raise Reject(why)
            except Reject as exc:
                await self._dead_letter(msg, f"rejected by stage {self.stage.name}: {exc}")
                return
            except Exception as exc:
                await self._failed(msg, exc, mctx)
                return
            finally:
                heartbeat.cancel()
            try:
                await msg.ack()
            except Exception as exc:  # redelivered later; outputs dedupe by event id
                mctx.log.warning("ack failed", error=repr(exc))
                return
            self.stats.processed += 1

    async def _heartbeat(self, msg: Message) -> None:
        """Long handlers (a long generation) must not look dead: reset the ack timer."""
        period = max(self.stage.retry.ack_wait_s / 3, 0.05)
        while True:
            await asyncio.sleep(period)
            with contextlib.suppress(Exception):
                await msg.in_progress()

    async def _failed(self, msg: Message, exc: Exception, mctx: Context) -> None:
        retry = self.stage.retry
        error = f"{type(exc).__name__}: {exc}"
        if msg.num_delivered >= retry.max_deliver:
            mctx.log.error("handler failed on last delivery", error=error)
            reason = f"handler failed on delivery {msg.num_delivered}/{retry.max_deliver}: {error}"
            await self._dead_letter(msg, reason)
            return
        delay = retry.delay(msg.num_delivered)
        mctx.log.warning("handler failed; will retry", error=error, retry_in_s=delay)
        self.stats.retried += 1
        with contextlib.suppress(Exception):
            await msg.nak(delay=delay)

    async def _dead_letter(self, msg: Message, reason: str) -> None:
        if await dead_letter(self.bus, msg, self.stage.name, reason):
            self.ctx.log.warning("dead-lettered", reason=reason[:300], deliveries=msg.num_delivered)
            self.stats.dead_lettered += 1
