"""The live dispatcher: prompts in, version-tagged GRPO groups out, ledger kept in the KV store.

It holds at most one prompt it cannot admit yet (unacked, heartbeated): the rest wait in the
bounded ``prompts`` work queue, which blocks the prompt source — backpressure all the way up,
never an unbounded buffer. Observations feed the pure ``Dispatcher``:

- engine assignments from ``EngineStatus`` (which versions have an engine),
- finished samples from ``scored`` (a group is finished when all its samples are scored),
- consumption from the learner's ``Metrics`` (``consumed_groups``, and its step),
- published versions from ``weights``,
- requests an engine refused after dispatch, from ``deadletter``: their groups can never
  finish, so they are abandoned (settled: nobody waits for them or trains on them).

Every change rewrites the ``Ledger`` (KV key ``ledger``) the learner and orchestrator read,
and the dispatcher's own state (KV key ``dispatcher``, ``dora.rollout.dispatcher_snapshot``)
before the messages that changed it are acked: a restarted dispatcher (``dora run --resume``,
or its process killed) continues from that state, and the bus redelivers what came after.
Request event ids are derived from request ids, so a re-publish after a crash is deduplicated.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from dora.aio import cancel_all
from dora.bus import Bus, ConsumerSpec, Message
from dora.events import (
    Metrics,
    Prompt,
    RolloutRequest,
    ScoredTrajectory,
    WeightVersion,
)
from dora.rollout.dispatcher import Dispatcher, PromptRefused, Tokenize
from dora.rollout.dispatcher_snapshot import SNAPSHOT_KEY, DispatcherSnapshot
from dora.rollout.observation import InvalidEvent, parsed, refused_request_id
from dora.rollout.status_board import StatusBoard
from dora.stage.deadletter import dead_letter, parse_event
from dora.stage.pull import Puller, observe
from dora.subjects import LEDGER_KEY
from dora.versions import check_published

log = structlog.get_logger(__name__)

PROMPT_ACK_WAIT_S = 5.0
"""The prompt being admitted is heartbeated every second while it waits; after a crash it
(and so every prompt behind it: one is pending at a time) is redelivered this soon."""


def request_event_id(request: RolloutRequest) -> str:
    return f"req-{request.request_id}-v{request.version}"


@dataclass
class DispatchStats:
    """Counters for tests and reports."""

    prompts: int = 0
    groups: int = 0
    requests: int = 0
    refusals: dict[str, int] = field(default_factory=dict)
    abandoned: int = 0
    """Groups abandoned because an engine refused one of their requests."""


class DispatchService:
    """``await run()`` until ``stop()`` or until ``max_prompts`` have been dispatched."""

    def __init__(
        self,
        bus: Bus,
        dispatcher: Dispatcher,
        max_prompts: int | None = None,
        retry_s: float = 0.05,
    ) -> None:
        self.bus = bus
        self.dispatcher = dispatcher
        self.max_prompts = max_prompts
        self.retry_s = retry_s
        self.stats = DispatchStats()
        self.done = asyncio.Event()
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()
        self.engines = StatusBoard(bus, on_change=self._changed.set)
        """Which versions have an engine (a bad status is the orchestrator's to dead-letter)."""
        self._lock = asyncio.Lock()
        self._log = log.bind(stage="dispatcher", mode=dispatcher.config.mode)

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()

    async def run(self) -> None:
        # The previous dispatcher's state first: an observer that applied an event (and wrote
        # a snapshot) before it would both reject what it knew and overwrite its state.
        await self._restore()
        s = self.bus.subjects
        await self.engines.start()
        consumers = {
            "scored": await self.bus.consumer(ConsumerSpec("dispatcher", s.scored)),
            "metrics": await self.bus.consumer(ConsumerSpec("dispatcher", s.metrics)),
            "weights": await self.bus.consumer(ConsumerSpec("dispatcher", s.weights)),
            "deadletter": await self.bus.consumer(ConsumerSpec("dispatcher", s.deadletter)),
        }
        prompts = await self.bus.consumer(
            ConsumerSpec("dispatcher", s.prompts, max_ack_pending=1, ack_wait_s=PROMPT_ACK_WAIT_S)
        )
        apply = {
            "scored": parsed(ScoredTrajectory, self._on_scored),
            "metrics": parsed(Metrics, self._on_metrics),
            "weights": parsed(WeightVersion, self._on_weights),
            "deadletter": self._on_dead_letter,
        }
        tasks = [
            asyncio.create_task(observe(consumers[name], self.observer(fn), "dispatcher"))
            for name, fn in apply.items()
        ]
        await self._write_ledger()
        try:
            await self._dispatch_loop(Puller(prompts, "dispatcher"))
        finally:
            await cancel_all(tasks)
            await self.engines.close()
            for consumer in (*consumers.values(), prompts):
                await consumer.close()

    async def _restore(self) -> None:
        """Continue from the state a previous dispatcher of this run left (if any)."""
        raw = await self.bus.kv_get(SNAPSHOT_KEY)
        if not raw:
            return
        self.dispatcher.restore(DispatcherSnapshot.model_validate_json(raw))
        await self._publish(self.dispatcher.unpublished)
        self._log.info(
            "dispatcher_restored",
            groups_admitted=self.dispatcher.groups_admitted,
            open_groups=self.dispatcher.in_flight(),
            learner_step=self.dispatcher.learner_step,
            newest_version=self.dispatcher.newest_version,
        )

    # ------------------------------------------------------------------ dispatching

    def _finished_quota(self) -> bool:
        admitted = self.dispatcher.groups_admitted
        return self.max_prompts is not None and admitted >= self.max_prompts

    async def _dispatch_loop(self, prompts: Puller) -> None:
        while not self._stop.is_set() and not self._finished_quota():
            for msg in await prompts.fetch(1, 0.5):
                await self._dispatch(msg)
        if self._finished_quota():
            self.done.set()
            await self._stop.wait()

    async def _dispatch(self, msg: Message) -> None:
        prompt, reason = parse_event(Prompt, msg.data)
        if prompt is None:
            await self._dead_letter(msg, reason)
            return
        if self.dispatcher.admitted_before(prompt):  # admitted, then crashed before the ack
            await msg.ack()
            return
        try:
            self.dispatcher.check_prompt(prompt)
        except PromptRefused as exc:
            await self._dead_letter(msg, f"refused: {exc}")
            return
        while not self._stop.is_set():
            async with self._lock:
                assigned = [st.assigned_version for st in self.engines.latest.values()]
                admission = self.dispatcher.admit(prompt, assigned)
            if admission.admitted:
                break
            self.stats.refusals[admission.reason] = self.stats.refusals.get(admission.reason, 0) + 1
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=self.retry_s * 20)
            await msg.in_progress()
        else:
            await msg.nak()
            return
        await self._write_ledger()  # the group exists before any of its requests does
        await self._publish(admission.requests)
        await msg.ack()
        self.stats.prompts += 1
        self.stats.groups += 1
        self.stats.requests += len(admission.requests)
        await self._write_ledger()

    async def _publish(self, requests: tuple[RolloutRequest, ...]) -> None:
        for request in requests:
            event = request.model_copy(update={"event_id": request_event_id(request)})
            await self.bus.publish_event(self.bus.subjects.requests(request.version), event)
        self.dispatcher.mark_published()

    async def _dead_letter(self, msg: Message, reason: str) -> None:
        self._log.warning("dead_lettered", subject=msg.subject, reason=reason[:300])
        await dead_letter(self.bus, msg, "dispatcher", reason)

    async def _write_ledger(self) -> None:
        """The dispatcher's state, then the ledger derived from it (both before any ack)."""
        await self.bus.kv_put(SNAPSHOT_KEY, self.dispatcher.snapshot().model_dump_json().encode())
        ledger = self.dispatcher.ledger()
        await self.bus.kv_put(LEDGER_KEY, ledger.model_dump_json().encode())

    # ------------------------------------------------------------------ observations

    def observer(
        self, apply: Callable[[Message], Awaitable[None]]
    ) -> Callable[[list[Message]], Awaitable[None]]:
        """Apply each batch of observations under the lock, then write the state once and
        settle each message: acked, or dead-lettered with the reason ``apply`` raised."""

        async def observed(msgs: list[Message]) -> None:
            rejected: dict[int, str] = {}
            async with self._lock:
                for msg in msgs:
                    try:
                        await apply(msg)
                    except InvalidEvent as exc:
                        rejected[id(msg)] = str(exc)
                    except (ValueError, KeyError) as exc:
                        rejected[id(msg)] = f"{type(exc).__name__}: {exc}"
            await self._write_ledger()
            for msg in msgs:  # kept with the reason, never silently dropped
                if id(msg) in rejected:
                    await self._dead_letter(msg, rejected[id(msg)])
                else:
                    await msg.ack()
            self._changed.set()

        return observed

    async def _on_dead_letter(self, msg: Message) -> None:
        """Abandon the group of a request a generator dead-lettered. Any other dead letter
        is none of the dispatcher's business (and is never dead-lettered again)."""
        request_id = refused_request_id(msg.data, self.bus.subjects)
        if request_id and self.dispatcher.on_abandoned(request_id):
            self.stats.abandoned += 1

    async def _on_scored(self, scored: ScoredTrajectory) -> None:
        request = scored.trajectory.request
        self.dispatcher.on_finished(request.request_id, request.group_id, request.dispatch_version)

    async def _on_metrics(self, metrics: Metrics) -> None:
        taken = metrics.step + 1  # Metrics.step is the index of the step just taken
        if taken > self.dispatcher.newest_version + 1:  # its weights are announced first
            await check_published(self.bus, taken, "Metrics.step + 1")
        if metrics.consumed_groups:
            self.dispatcher.on_consumed(metrics.consumed_groups, learner_step=taken)
        else:
            self.dispatcher.observe_learner_step(taken)

    async def _on_weights(self, event: WeightVersion) -> None:
        if event.version > self.dispatcher.newest_version:
            await check_published(
                self.bus, event.version, "WeightVersion.version", checksum=event.checksum
            )
        self.dispatcher.observe_weights(event.version)


__all__ = [
    "DispatchService",
    "Tokenize",
    "refused_request_id",
    "request_event_id",
]
