"""A sink that counts scored trajectories (each event id once) and completes after ``expect``.

What it counted is appended to ``RUN_DIR/state/<name>.counted`` before the event is acked, so
a resumed run (``dora run --resume``: same run, same KV store) counts the events of the
earlier process too, and an event redelivered after a crash is still counted once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dora.bus import Consumer, ConsumerSpec
from dora.events import DeadLetter, ScoredTrajectory
from dora.stage import Context, Stage
from dora.stage.pull import Puller
from dora.subjects import sink_counted_key


class CountingSinkConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    expect: int | None = Field(
        default=None, ge=0, description="Complete after this many distinct events (None: never)."
    )
    print_every: int = Field(default=0, ge=0, description="Log every k-th event (0: never).")
    count_dead_letters: bool = Field(
        default=False,
        description="Also count the run's dead letters toward `expect`, so a run whose "
        "upstream stages dead-lettered some events still completes (and reports them).",
    )


class CountingSink(Stage):
    """Counts distinct ``ScoredTrajectory`` events, rewards and correct ones.

    Redelivered events (same event id) are counted once, so its totals are exactly-once.
    """

    name = "sink"
    consumes = "scored"
    kv_writes = ("sink.{name}.>",)
    concurrency = 16
    Config = CountingSinkConfig

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: set[str] = set()
        self.correct = 0
        self.reward_sum = 0.0
        self.errors = 0
        self.redelivered = 0
        self.dead: set[str] = set()
        self._dead_task: asyncio.Task[None] | None = None
        self._dead_consumer: Consumer | None = None
        self._journal: IO[str] | None = None

    @property
    def finite(self) -> bool:  # type: ignore[override]
        return self.config.expect is not None

    async def setup(self, ctx: Context) -> None:
        if ctx.run_dir is not None:
            path = Path(ctx.run_dir) / "state" / f"{self.name}.counted"
            path.parent.mkdir(parents=True, exist_ok=True)
            # the bus's KV store says whether this run counted before (a resume), not the file:
            # a new run reusing a folder starts from zero
            key = sink_counted_key(self.name)
            if path.exists() and await ctx.bus.kv_get(key):
                self._replay(path.read_text(encoding="utf-8"))
            else:
                path.write_text("", encoding="utf-8")
                await ctx.bus.kv_put(key, b"1")
            self._journal = path.open("a", encoding="utf-8")
        if self.config.count_dead_letters:
            spec = ConsumerSpec(
                f"{self.name}-deadletters", ctx.bus.subjects.deadletter, max_ack_pending=1024
            )
            self._dead_consumer = await ctx.bus.consumer(spec)
            self._dead_task = asyncio.create_task(self._count_dead(ctx, self._dead_consumer))

    def _replay(self, text: str) -> None:
        """Counts of an earlier process of this run (a torn last line is skipped)."""
        for line in text.splitlines():
            try:
                kind, key, *values = json.loads(line)
                if kind == "D":
                    self.dead.add(str(key))
                elif kind == "S" and key not in self.seen:
                    reward, correct, error = float(values[0]), int(values[1]), int(values[2])
                    self.seen.add(str(key))
                    self.reward_sum += reward
                    self.correct += correct
                    self.errors += error
            except (ValueError, TypeError, IndexError):
                continue

    def _note(self, *fields: object) -> None:
        if self._journal is not None:
            self._journal.write(json.dumps(fields) + "\n")
            self._journal.flush()  # in the OS before the ack: survives a kill of this process

    async def teardown(self, ctx: Context) -> None:
        if self._dead_task is not None:
            self._dead_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dead_task
        if self._dead_consumer is not None:
            await self._dead_consumer.close()
        if self._journal is not None:
            self._journal.close()

    async def _count_dead(self, ctx: Context, consumer: Consumer) -> None:
        puller = Puller(consumer, self.name)
        while True:
            for msg in await puller.fetch(64, 0.25):
                try:
                    letter = DeadLetter.model_validate_json(msg.data)
                    key = letter.event_id
                    ctx.log.warning("dead letter", stage=letter.stage, reason=letter.reason[:200])
                except ValidationError:
                    key = f"seq-{msg.stream_seq}"
                if key not in self.dead:
                    self.dead.add(key)
                    self._note("D", key)
                await msg.ack()
            self._check(ctx)

    def _check(self, ctx: Context) -> None:
        expect = self.config.expect
        if expect is not None and len(self.seen) + len(self.dead) >= expect:
            ctx.complete()

    async def handle(self, scored: ScoredTrajectory, ctx: Context) -> None:
        if scored.event_id in self.seen:
            self.redelivered += 1
            return
        self.seen.add(scored.event_id)
        self.correct += int(scored.correct)
        self.reward_sum += scored.reward
        self.errors += int(bool(scored.error))
        error = int(bool(scored.error))
        self._note("S", scored.event_id, scored.reward, int(scored.correct), error)
        count = len(self.seen)
        if self.config.print_every and count % self.config.print_every == 0:
            prompt = scored.trajectory.request.prompt
            ctx.log.info(
                "scored",
                count=count,
                prompt_id=prompt.prompt_id,
                reward=scored.reward,
                answer=prompt.answer,
            )
        self._check(ctx)

    def progress_total(self) -> int | None:
        return self.config.expect

    def summary(self) -> dict[str, Any]:
        count = len(self.seen)
        return {
            "count": count,
            "correct": self.correct,
            "accuracy": self.correct / count if count else 0.0,
            "mean_reward": self.reward_sum / count if count else 0.0,
            "verifier_errors": self.errors,
            "redelivered": self.redelivered,
            "dead_letters": len(self.dead),
        }
