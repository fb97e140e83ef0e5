"""Multi-turn episodes, driven by the generator: the engine samples, the environment reacts.

The generator owns the loop. A pulled request is an episode: its environment's opening
messages (a reset, turn 0, on ``env_steps.any``) are rendered into the prompt; the engine
decodes until the turn ends (a turn stop string, or a stop: ``park_on_stop``) and parks the
request with its KV resident; the turn's text goes to the replica that owns the episode
(``env_steps.<owner>``); its reply is rendered, appended, and decoding goes on, on the same
engine and version, until the environment says done. Earlier turns are never re-prefilled,
the history is never decoded and encoded again (``dora.envs.chat``), and the reply's tokens
are masked out of the loss.

Replies are stored (``env_replies.<episode>``) and read live by every generator; a generator
that imports a migrated episode reads the stored ones to learn where it stands, so a reply
reaches the episode's engine even after it moved. The episode's record (per-turn rewards and
metrics, tool calls, errors) is built from its replies (the stored ones, after a move).

Failures: a reply not received within ``reply_timeout_s``, a ``lost`` reply (the replica
restarted) or an environment error retries the episode ``retries`` times on a fresh
environment (same version and seed, the engine's tokens of the failed attempt dropped); after
that the trajectory is published with the error and a zero loss mask, never dropped.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog
from pydantic import BaseModel, ConfigDict, Field

from dora.bus import Bus, Message
from dora.engines.base import EngineError, TurnEnd
from dora.envs.chat import Chat, ChatFormat
from dora.events import EnvReply, EnvStep, EpisodeRecord, RolloutRequest, Trajectory
from dora.rollout.generator_core import Admitted, GeneratorCore, Held
from dora.stage.deadletter import parse_event

log = structlog.get_logger(__name__)


class EpisodeConfig(BaseModel):
    """A generator whose requests are multi-turn episodes in ``environment``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    environment: str = Field(min_length=1, description="The environment stage's environment.")
    turn_stop_strings: tuple[str, ...] = Field(
        default=("</tool_call>",), description="Text that ends an assistant turn."
    )
    chat: Chat = Field(default_factory=ChatFormat, description="ChatFormat or TemplateFormat.")
    reply_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="A step unanswered this long: its environment replica is presumed dead "
        "and the episode is retried.",
    )
    retries: int = Field(default=1, ge=0, le=3, description="Fresh-environment retries.")


@dataclass
class Episode:
    """The generator's view of one live episode."""

    request: RolloutRequest
    version: int
    queue: int | None
    attempt: int = 0
    first_attempt: int = 0
    """A request opened again (handed back, or its engine died) starts past every attempt
    already answered: a reply's id is (episode, attempt, turn), and the bus drops a repeat."""
    turns: int = 0
    """Assistant turns handed to the environment."""
    awaiting: int | None = 0
    """The turn whose reply is awaited (None while the engine decodes)."""
    owner: str = "any"
    deadline: float = 0.0
    ended: Trajectory | None = None
    """Cut off by the length limit: published once the environment has seen its last turn."""
    replies: dict[int, EnvReply] = field(default_factory=dict)
    """This attempt's replies by turn (read from the stored ones after a migration)."""


@dataclass
class EpisodeStats:
    opened: int = 0
    retried: int = 0
    failed: int = 0
    adopted: int = 0


Publish = Callable[[Trajectory], Awaitable[None]]


class Episodes:
    """The live episodes of one generator (see module docstring)."""

    def __init__(
        self,
        config: EpisodeConfig,
        core: GeneratorCore,
        bus: Bus,
        encode: Callable[[str, bool], list[int]],
        decode: Callable[[list[int]], str],
        publish: Publish,
        wake: Callable[[], None],
    ) -> None:
        self.config = config
        self.core = core
        self.bus = bus
        self.encode = encode
        self.decode = decode
        self.publish = publish
        self.wake = wake
        self.engine_id = core.config.engine_id
        self.live: dict[str, Episode] = {}
        self.stats = EpisodeStats()
        self._log = log.bind(engine=self.engine_id)

    # ------------------------------------------------------------------ starting

    async def open(
        self, request: RolloutRequest, lease: Message, version: int, queue: int | None
    ) -> Admitted:
        """A pulled request: ask its environment for the opening messages (the request joins
        the engine when they come back)."""
        rid = request.request_id
        if rid in self.core.held:
            return await self.core.admit(request, lease, version, queue)  # a lapsed lease
        if rid in self.core.opening:
            self.core.opening[rid].lease = lease
            return "renewed"
        if not self.core.admissible(request, version, queue):
            return "not_ours"
        self.core.opening[rid] = Held(lease)
        attempt = 0
        if lease.num_delivered > 1:  # handed back or redelivered: it may have been started
            earlier = [r.attempt for r in await self.stored_replies(rid)]
            attempt = max(earlier) + 1 if earlier else 0
        episode = Episode(request, version, queue, attempt=attempt, first_attempt=attempt)
        self.live[rid] = episode
        self.stats.opened += 1
        await self._send(episode, 0)
        return "added"

    async def _started(self, episode: Episode, reply: EnvReply) -> None:
        """The opening messages: render them and add the request to the engine."""
        rid = episode.request.request_id
        held = self.core.opening.pop(rid, None)
        if held is None:
            return
        ids = self.encode(self.config.chat.opening(reply.messages), True)
        sampling = episode.request.sampling.model_copy(
            update={"turn_stop_strings": self.config.turn_stop_strings, "park_on_stop": True}
        )
        request = episode.request.model_copy(
            update={"prompt_token_ids": tuple(ids), "sampling": sampling}
        )
        try:
            admitted = await self.core.admit(request, held.lease, episode.version, episode.queue)
        except EngineError as exc:  # e.g. the opening does not fit the context
            self.core.opening[rid] = held
            await self._fail(episode, f"{type(exc).__name__}: {exc}")
            return
        if admitted == "not_ours":  # reassigned while the environment started it
            self.live.pop(rid, None)
            await held.lease.nak()
        self.wake()

    # ------------------------------------------------------------------ turns

    async def turn_ends(self, ends: list[TurnEnd]) -> None:
        """Parked requests: hand each turn to its environment."""
        for end in ends:
            episode = self.live.get(end.request_id)
            if episode is None or end.request_id not in self.core.held:
                continue  # not an episode, or an attempt dropped for a retry
            episode.turns += 1
            await self._send(episode, episode.turns, end.text)

    async def finished(self, trajectory: Trajectory) -> bool:
        """A request the engine finished: an episode's (cut off by the length limit) waits for
        its environment to see the last turn (a call in it is never run). False: not ours."""
        rid = trajectory.request.request_id
        episode = self.live.get(rid)
        if episode is None:
            return False
        if rid not in self.core.held:
            return True  # an attempt dropped for a retry, finished on its way out
        episode.ended = trajectory
        episode.turns += 1
        last = trajectory.turns[-1] if trajectory.turns else None
        start = last.start if last is not None and last.role == "assistant" else 0
        text = self.decode(list(trajectory.completion_token_ids[start:]))
        await self._send(episode, episode.turns, text, truncated=True)
        return True

    async def _send(self, episode: Episode, turn: int, text: str = "", **extra: bool) -> None:
        from dora.envs.service import ANY, step_event_id

        episode.awaiting = turn
        episode.deadline = time.monotonic() + self.config.reply_timeout_s
        step = EnvStep(
            episode_id=episode.request.request_id,
            attempt=episode.attempt,
            turn=turn,
            environment=self.config.environment,
            prompt=episode.request.prompt,
            seed=episode.request.sampling.seed,
            version=episode.version,
            engine=self.engine_id,
            text=text,
            **extra,
        )
        step = step.model_copy(update={"event_id": step_event_id(step)})
        owner = ANY if turn == 0 else episode.owner
        if turn > 0 and episode.ended is None:
            self.core.parked.add(episode.request.request_id)
            self.wake()  # a decode slot is free: pull more
        await self.bus.publish_event(self.bus.subjects.env_steps(owner), step)

    async def reply(self, reply: EnvReply) -> None:
        """A reply from any environment: act on it if it is the one an episode here awaits."""
        episode = self.live.get(reply.episode_id)
        if episode is None or (reply.attempt, reply.turn) != (episode.attempt, episode.awaiting):
            return  # another engine's, a duplicate, or a failed attempt's
        held = self.core.held.get(reply.episode_id)
        if held is not None and held.exported:
            return  # moving: the importing engine reads it from the stored replies
        episode.awaiting = None
        episode.owner = reply.owner
        episode.replies[reply.turn] = reply
        self.core.parked.discard(reply.episode_id)
        if reply.lost or reply.error:
            await self._retry_or_fail(episode, reply.error or "environment lost the episode")
        elif episode.ended is not None:
            await self._end(episode, episode.ended)
        elif reply.turn == 0:
            await self._started(episode, reply)
        elif reply.done:
            await self._end(episode, await self.core.call(self._end_in_engine, reply.episode_id))
        else:
            await self._append(episode, reply)

    def _end_in_engine(self, request_id: str) -> Trajectory:
        return self.core.engine.end_episode(request_id)  # type: ignore[attr-defined]

    async def _append(self, episode: Episode, reply: EnvReply) -> None:
        rid = episode.request.request_id
        ids = self.encode(self.config.chat.reply(reply.messages), False)
        try:
            await self.core.call(self.core.engine.append, rid, ids)  # type: ignore[attr-defined]
        except EngineError as exc:  # the reply does not fit the context: the episode ends
            self._log.info("episode_context_full", request=rid, reason=str(exc)[:200])
            trajectory = await self.core.call(self._end_in_engine, rid)
            await self._end(episode, trajectory.model_copy(update={"finish_reason": "length"}))
            return
        self.wake()

    # ------------------------------------------------------------------ ending

    async def _end(self, episode: Episode, trajectory: Trajectory, error: str = "") -> None:
        """Publish the episode's trajectory with its record (read from the stored replies)."""
        rid = episode.request.request_id
        self.live.pop(rid, None)
        self.core.parked.discard(rid)
        record = self._record(episode, error)
        update: dict[str, object] = {"episode": record, "text": self._assistant_text(trajectory)}
        if error:
            update |= {
                "loss_mask": (0,) * len(trajectory.completion_token_ids),
                "finish_reason": "error",
                "error": error,
            }
        await self.publish(trajectory.model_copy(update=update))

    def _assistant_text(self, trajectory: Trajectory) -> str:
        """What verifiers read: the model's turns only, never environment text."""
        if not trajectory.turns:
            return trajectory.text
        ids = trajectory.completion_token_ids
        spans = [t for t in trajectory.turns if t.role == "assistant"]
        return "".join(self.decode(list(ids[t.start : t.end])) for t in spans)

    def _record(self, episode: Episode, error: str) -> EpisodeRecord:
        replies = {turn: r for turn, r in episode.replies.items() if turn > 0}
        ordered = [replies[t] for t in sorted(replies)]
        metrics = [r.metrics for r in ordered]
        final = ordered[-1] if ordered else None
        return EpisodeRecord(
            environment=self.config.environment,
            turns=len(ordered),
            reward=final.reward if final is not None and final.done and not error else None,
            turn_rewards=tuple(r.reward for r in ordered),
            turn_metrics=tuple(metrics),
            tool_calls=int(sum(m.get("tool_calls", 0.0) for m in metrics)),
            tool_call_errors=int(sum(m.get("tool_call_errors", 0.0) for m in metrics)),
            tool_seconds=sum(m.get("tool_seconds", 0.0) for m in metrics),
            attempts=episode.attempt - episode.first_attempt + 1,
            error=error,
        )

    async def _retry_or_fail(self, episode: Episode, reason: str) -> None:
        """Start again on a fresh environment (the failed attempt's tokens are dropped), or,
        out of retries, publish the trajectory with the error."""
        if episode.attempt - episode.first_attempt >= self.config.retries:
            await self._fail(episode, reason)
            return
        rid = episode.request.request_id
        self._log.warning("episode_retried", request=rid, reason=reason[:200])
        self.core.parked.discard(rid)
        held = self.core.held.pop(rid, None)
        if held is not None:
            with contextlib.suppress(EngineError):  # it finished meanwhile: dropped as stale
                await self.core.call(self.core.engine.abort, rid)
            self.core.opening[rid] = held
        episode.attempt += 1
        episode.turns, episode.owner, episode.ended = 0, "any", None
        episode.replies = {}
        self.stats.retried += 1
        await self._send(episode, 0)

    async def _fail(self, episode: Episode, reason: str) -> None:
        """Out of retries: the trajectory with what was generated, the error and a zero mask."""
        rid = episode.request.request_id
        self.stats.failed += 1
        self._log.warning("episode_failed", request=rid, reason=reason[:200])
        trajectory = episode.ended
        if trajectory is None and rid in self.core.held:
            part = await self.core.call(self.core.engine.abort, rid)
            trajectory = _trajectory(part.request, part.token_ids, part.logprobs, part.engines)
        if trajectory is None:  # never reached the engine: its lease is settled as any other
            held = self.core.opening.pop(rid, None)
            if held is not None:
                self.core.held[rid] = held
            trajectory = _trajectory(episode.request, (), (), ())
        await self._end(episode, trajectory, error=reason)

    # ------------------------------------------------------------------ migration and time

    async def stored_replies(self, request_id: str) -> list[EnvReply]:
        subject = self.bus.subjects.env_replies(request_id)
        replies = []
        async for stored in self.bus.stream_messages(subject):
            reply, _ = parse_event(EnvReply, stored.data)
            if reply is not None and reply.episode_id == request_id:
                replies.append(reply)
        return replies

    async def adopt(self, request_id: str) -> None:
        """An imported request: if it is an episode, learn where it stands from its stored
        replies (its attempt, owner, and the reply it waits for, perhaps already there)."""
        replies = await self.stored_replies(request_id)
        if not replies:
            return  # not an episode (or one whose opening was never answered)
        request, parked, appended = await self.core.call(
            self.core.engine.episode_state,  # type: ignore[attr-defined]
            request_id,
        )
        attempt = max(r.attempt for r in replies)
        mine = [r for r in replies if r.attempt == attempt]
        episode = Episode(request, request.version, None, attempt=attempt, first_attempt=attempt)
        episode.owner = max(mine, key=lambda r: r.turn).owner
        episode.replies = {r.turn: r for r in mine}
        episode.turns = appended + 1 if parked else appended
        episode.awaiting = episode.turns if parked else None
        episode.deadline = time.monotonic() + self.config.reply_timeout_s
        self.live[request_id] = episode
        if parked:
            self.core.parked.add(request_id)
        self.stats.adopted += 1
        await self.catch_up(request_id, mine)

    async def catch_up(self, request_id: str, replies: list[EnvReply] | None = None) -> None:
        """Apply the awaited reply if it is already stored (it came while the episode moved)."""
        episode = self.live.get(request_id)
        if episode is None or episode.awaiting is None:
            return
        for reply in replies if replies is not None else await self.stored_replies(request_id):
            if (reply.attempt, reply.turn) == (episode.attempt, episode.awaiting):
                await self.reply(reply)
                return

    def forget(self, request_id: str) -> None:
        """It moved to another engine for good."""
        self.live.pop(request_id, None)
        self.core.parked.discard(request_id)

    async def check_deadlines(self) -> None:
        """Retry (or fail) the episodes whose awaited reply is overdue."""
        now = time.monotonic()
        for rid, episode in list(self.live.items()):
            if episode.awaiting is None or episode.deadline > now:
                continue
            held = self.core.held.get(rid)
            if held is not None and held.exported:
                continue
            await self.catch_up(rid)  # missed live (a reconnect)?
            if episode.awaiting is not None and self.live.get(rid) is episode:
                await self._retry_or_fail(
                    episode,
                    f"no reply from environment {episode.owner} within "
                    f"{self.config.reply_timeout_s:g} s (turn {episode.awaiting})",
                )


def _trajectory(
    request: RolloutRequest,
    token_ids: tuple[int, ...],
    logprobs: tuple[float, ...],
    engines: tuple[str, ...],
) -> Trajectory:
    return Trajectory(
        request=request,
        version=request.version,
        prompt_token_ids=request.prompt_token_ids,
        completion_token_ids=token_ids,
        logprobs=logprobs,
        loss_mask=(0,) * len(token_ids),
        finish_reason="error",
        engines=engines,
    )
