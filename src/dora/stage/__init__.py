"""Stages: typed async handlers between NATS subjects, with ack/retry/dead-letter and drain.

Declaring a stage
-----------------
A class::

    class Score(Stage):
        consumes = "trajectories"                 # subject reference, resolved per run
        emits = {ScoredTrajectory: "scored"}      # where each returned event type goes
        concurrency = 8                           # in flight per replica (= ack window)
        retry = RetryPolicy(max_deliver=5, backoff_s=0.5)
        Config = ScoreConfig                      # pydantic model of the YAML `config:`

        async def setup(self, ctx): self.verifier = make_verifier(self.config.verifier)
        async def handle(self, traj: Trajectory, ctx: Context) -> ScoredTrajectory:
            ...                                   # input model = the annotation

or a function::

    @stage(consumes="trajectories", emits={ScoredTrajectory: "scored"}, concurrency=8)
    async def score(traj: Trajectory, ctx: Context) -> ScoredTrajectory: ...

A *source* has no input: override ``produce(self, ctx)`` as an async generator (or decorate
an ``async def f(ctx)`` generator); each yielded event is published before the next one is
asked for, so a full stream slows the source down. A *sink* simply emits nothing.

Publishing
----------
Return an event, an iterable of events, or ``None``; each is routed by its type through
``emits``. For a dynamic subject (``requests.v3``) call ``await ctx.publish(event,
to="requests.v3")`` inside the handler. Publishing is ``bus.publish_event``: deduplicated by
``event_id``. The input is acked only after the handler returned and every publish is stored,
so a crash means redelivery; derive output ids from the input (``derived_id(event.event_id,
"traj", i)``) and a redelivered input republishes the *same* ids, which the server drops:
exactly-once downstream. Sources should likewise use deterministic ids.

Failures
--------
A payload that fails validation (bad JSON, non-utf-8, wrong types, unknown fields, wrong
``schema_version``, over-long strings) is published as a ``DeadLetter`` on
``subjects.deadletter`` with the validation errors as reason, then termed. A handler that
raises is retried by nak with exponential backoff (``RetryPolicy``); on its last allowed
delivery it is dead-lettered. ``raise Reject("why")`` dead-letters at once.

Completion
----------
``finite = True`` stages end a pipeline run: a source when ``produce`` returns, any other
stage when it calls ``ctx.complete()`` (e.g. a sink that has seen N distinct events). When
every finite stage of a pipeline is complete, the pipeline stops all stages (draining them).
A pipeline without finite stages runs until ``stop()``.

Context
-------
``ctx.run_id``, ``ctx.bus``, ``ctx.config``, ``ctx.stats``, ``ctx.log`` (structlog, bound to
run/stage and, per message, subject/event_id/deliveries), ``ctx.deliveries``,
``ctx.publish(event, to=None)``, ``ctx.complete()``, ``ctx.hold()``.

Holding messages (batching consumers such as a learner)
-------------------------------------------------------
``h = ctx.hold()`` inside ``handle`` keeps the message unacked after the handler returns
(its ack timer kept alive, its concurrency slot taken) until the stage calls ``h.ack()``,
``h.nak()`` or ``h.reject(reason)``: ack a batch only once it has been trained on, and a
crash before that redelivers the whole batch. Needs ``concurrency >= batch size``. On
``stop`` the messages still held are nak'ed at once (redelivered to the next run).
"""

from dora.stage.base import (
    Emitted,
    EmptyConfig,
    Reject,
    RetryPolicy,
    Stage,
    StageError,
    derived_id,
    resolve_subject,
)
from dora.stage.context import Context, Hold, StageStats
from dora.stage.function import FunctionStage, stage
from dora.stage.runner import StageRunner

__all__ = [
    "Context",
    "Emitted",
    "EmptyConfig",
    "FunctionStage",
    "Hold",
    "Reject",
    "RetryPolicy",
    "Stage",
    "StageError",
    "StageRunner",
    "StageStats",
    "derived_id",
    "resolve_subject",
    "stage",
]
