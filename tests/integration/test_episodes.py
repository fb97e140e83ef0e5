"""Multi-turn episodes on a real nats-server: generators with the built-in engine drive
episodes through an environment service; a parked episode migrates with its KV."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dora.bus import ConsumerSpec, NatsBus
from dora.bus.server import NatsServer
from dora.engines.torch import TorchEngine
from dora.envs import AssistantTurn, ChatMessage, StepResult
from dora.envs.chat import ChatFormat, TemplateFormat
from dora.envs.host import EnvironmentHost
from dora.envs.service import EnvironmentService
from dora.events import (
    AssignVersion,
    Drain,
    Migrate,
    Prompt,
    RolloutRequest,
    SamplingParams,
    Trajectory,
)
from dora.rollout.episodes import EpisodeConfig
from dora.rollout.generator import Generator
from dora.rollout.generator_config import GeneratorConfig
from dora.rollout.migrator import Migrator
from dora.subjects import Subjects
from tests.integration.test_generator import bus2, collect, running, until
from tests.unit.test_engine_support import make_engine

pytestmark = pytest.mark.nats
__all__ = ["bus2"]

TURN_END = tuple("etaoinshrdlu#%&?!=:;")  # the random tiny model writes one within a few tokens
CHAT = ChatFormat()


class Scripted:
    """Replies ``<r>k</r>`` to the first ``turns - 1`` turns, then ends with reward ``turns``.
    ``gate``: each step waits for it (a slow tool)."""

    def __init__(
        self,
        turns: int = 3,
        gate: asyncio.Event | None = None,
        opening: asyncio.Event | None = None,
    ) -> None:
        self.turns, self.gate, self.opening, self.seen = turns, gate, opening, 0

    async def reset(self, prompt: Prompt, seed: int) -> list[ChatMessage]:
        if self.opening is not None:
            await self.opening.wait()
        return [ChatMessage(role="user", content=f"{prompt.text} (seed {seed})")]

    async def step(self, turn: AssistantTurn) -> StepResult:
        if self.gate is not None:
            await self.gate.wait()
        self.seen += 1
        if self.seen >= self.turns:
            return StepResult(done=True, reward=float(self.seen), metrics={"tool_calls": 0.0})
        return StepResult(
            messages=[ChatMessage(role="tool", content=f"<r>{self.seen}</r>")],
            reward=0.5,
            metrics={"tool_calls": 1.0, "tool_seconds": 0.25},
        )

    async def close(self) -> None:
        return None


@contextlib.asynccontextmanager
async def environment(bus: NatsBus, make: Any, owner: str = "env-0") -> AsyncIterator[Any]:
    host = EnvironmentHost(owner, "scripted", make)
    service = EnvironmentService(host, bus)
    task = asyncio.create_task(service.run())
    await service.ready.wait()
    try:
        yield host
    finally:
        service.stop()
        await task


def episodic(bus: NatsBus, engine: TorchEngine, **config: Any) -> Generator:
    config.setdefault("turn_stop_strings", TURN_END)
    episodes = EpisodeConfig(environment="scripted", **config)

    async def same_weights(version: int) -> dict[str, Any]:
        return engine.model.state_dict()  # every version: the engine's own weights

    return Generator(
        engine,
        bus,
        same_weights,
        GeneratorConfig(engine_id=engine.engine_id, initial_version=0, episodes=episodes),
    )


def request(i: int, max_tokens: int = 200) -> RolloutRequest:
    return RolloutRequest(
        request_id=f"g-{i}/0",
        prompt=Prompt(prompt_id=f"p{i}", text=f"Problem {i}:"),
        group_id=f"g-{i}",
        group_index=0,
        version=0,
        sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i),
    )


def check_concatenation(
    traj: Trajectory, engine: TorchEngine, replies: list[str], chat: Any = CHAT
) -> None:
    """prompt = the rendered opening; completion = turn, reply, turn, reply, ..., turn; the
    mask 1 exactly on the sampled tokens."""
    tok = engine.tokenizer
    opening = chat.opening(
        [
            ChatMessage(
                role="user",
                content=f"{traj.request.prompt.text} (seed {traj.request.sampling.seed})",
            )
        ]
    )
    assert list(traj.prompt_token_ids) == tok.encode(opening, add_bos=True)
    roles = [t.role for t in traj.turns]
    assert roles == ["assistant", "tool"] * len(replies) + ["assistant"]
    ids = traj.completion_token_ids
    tool_spans = [t for t in traj.turns if t.role == "tool"]
    for span, reply in zip(tool_spans, replies, strict=True):
        assert list(ids[span.start : span.end]) == tok.encode(
            chat.reply([ChatMessage(role="tool", content=reply)]), add_bos=False
        )
    for span in traj.turns:
        want = 1 if span.role == "assistant" else 0
        assert set(traj.loss_mask[span.start : span.end]) == {want}
    assistant = "".join(
        tok.decode(list(ids[t.start : t.end])) for t in traj.turns if t.role == "assistant"
    )
    assert traj.text == assistant  # verifiers read the model's turns only


async def test_episodes_run_turn_by_turn_without_reprefilling(nats_bus: NatsBus) -> None:
    await nats_bus.consumer(ConsumerSpec("audit", nats_bus.subjects.trajectories))
    engine = make_engine("engine-0")
    gen = episodic(nats_bus, engine)
    for i in range(4):
        await nats_bus.publish_event(nats_bus.subjects.requests(0), request(i))
    async with environment(nats_bus, lambda: Scripted(turns=3)), running(gen):
        got = await collect(nats_bus, 4, timeout=60)
    assert len({t.request.request_id for t in got}) == 4
    prefilled = 0
    for traj in got:
        assert traj.finish_reason == "stop" and traj.reprefilled_tokens == 0
        check_concatenation(traj, engine, ["<r>1</r>", "<r>2</r>"])
        record = traj.episode
        assert record is not None and record.error == "" and record.attempts == 1
        assert record.turns == 3 and record.reward == 3.0  # the environment's reward passes
        assert record.turn_rewards == (0.5, 0.5, 3.0) and record.tool_calls == 2
        prefilled += len(traj.prompt_token_ids) + sum(
            t.end - t.start + 1 for t in traj.turns if t.role == "tool"
        )
    # each reply (and the turn's last sampled token) is prefilled once; earlier turns never
    assert engine.counters.prefill_tokens == prefilled


async def test_a_chat_template_renders_the_opening_and_each_reply(nats_bus: NatsBus) -> None:
    from tests.unit.test_env_host import CHATML

    await nats_bus.consumer(ConsumerSpec("audit", nats_bus.subjects.trajectories))
    engine = make_engine("engine-0")
    # the model ends a turn with "e" (the template writes it after each assistant message)
    chat = TemplateFormat(template=CHATML.replace("<|im_end|>", "e"), turn_end="e")
    gen = episodic(nats_bus, engine, chat=chat, turn_stop_strings=("e",))
    await nats_bus.publish_event(nats_bus.subjects.requests(0), request(5, max_tokens=1500))
    async with environment(nats_bus, lambda: Scripted(turns=3)), running(gen):
        (traj,) = await collect(nats_bus, 1, timeout=60)
    check_concatenation(traj, engine, ["<r>1</r>", "<r>2</r>"], chat)
    assert traj.episode is not None and traj.episode.reward == 3.0


async def test_a_parked_episode_migrates_and_its_reply_reaches_the_new_engine(
    nats_bus: NatsBus, bus2: NatsBus
) -> None:
    await nats_bus.consumer(ConsumerSpec("audit", nats_bus.subjects.trajectories))
    source_engine, target_engine = make_engine("src"), make_engine("dst")
    source, target = episodic(nats_bus, source_engine), episodic(bus2, target_engine)
    gate = asyncio.Event()
    await nats_bus.publish_event(nats_bus.subjects.requests(0), request(7))
    scripted = environment(nats_bus, lambda: Scripted(turns=2, gate=gate))
    async with scripted as host, running(source):
        # parked at the end of turn 1, its tool call waiting on the gate
        await until(lambda: host.live and source_engine.num_requests() == 1, 30)
        await until(lambda: source_engine.episode_state("g-7/0")[1], 30)
        async with running(target):
            for command in (Drain(engine_id="dst"), AssignVersion(engine_id="dst", version=0)):
                await nats_bus.request(
                    nats_bus.subjects.control("dst"), command.model_dump_json().encode()
                )
            prefill_before = target_engine.counters.prefill_tokens
            outcomes = await Migrator(nats_bus).execute(
                Migrate(source="src", target="dst", version=0, request_ids=("g-7/0",))
            )
            assert [o.ok for o in outcomes] == [True]
            assert source_engine.num_requests() == 0
            gate.set()  # the tool answers; its reply must find the episode on dst
            (traj,) = await collect(nats_bus, 1, timeout=60)
    assert traj.engines == ("src", "dst") and traj.version == 0
    assert [(m.source, m.target) for m in traj.migrations] == [("src", "dst")]
    assert traj.reprefilled_tokens == 0
    check_concatenation(traj, target_engine, ["<r>1</r>"])
    (reply_span,) = [t for t in traj.turns if t.role == "tool"]
    # the target computed only the reply and the turn's last token, never the history
    assert target_engine.counters.prefill_tokens - prefill_before == (
        reply_span.end - reply_span.start + 1
    )
    assert traj.episode is not None and traj.episode.reward == 2.0


class Broken:
    """Starts, then fails at every step."""

    async def reset(self, prompt: Prompt, seed: int) -> list[ChatMessage]:
        return [ChatMessage(role="user", content=prompt.text)]

    async def step(self, turn: AssistantTurn) -> StepResult:
        raise RuntimeError("the database is gone")

    async def close(self) -> None:
        return None


async def test_a_failing_environment_is_retried_once_then_the_trajectory_says_why(
    nats_bus: NatsBus,
) -> None:
    await nats_bus.consumer(ConsumerSpec("audit", nats_bus.subjects.trajectories))
    gen = episodic(nats_bus, make_engine("engine-0"))
    for i in range(3):
        await nats_bus.publish_event(nats_bus.subjects.requests(0), request(i))
    async with environment(nats_bus, Broken) as host, running(gen):
        got = await collect(nats_bus, 3, timeout=60)
    assert host.stats.episodes == 6  # each episode: the first attempt and one retry
    for traj in got:
        assert traj.finish_reason == "error" and "the database is gone" in traj.error
        assert traj.episode is not None and traj.episode.attempts == 2
        assert traj.episode.reward is None and "the database is gone" in traj.episode.error
        assert set(traj.loss_mask) <= {0}  # nothing of a failed episode is trained on
    assert gen.episodes is not None and gen.episodes.stats.retried == 3
    assert gen.episodes.stats.failed == 3 and gen.episodes.live == {}


def start_worker(url: str, run: str, owner: str, delay_s: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.env_worker", url, run, owner, str(delay_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


async def test_an_environment_killed_mid_episode_loses_no_request(
    nats_bus: NatsBus, nats_server: NatsServer, subjects: Subjects
) -> None:
    """SIGKILL the replica that owns every episode while they wait on its slow tool: each
    request still ends as exactly one trajectory, retried on a fresh environment elsewhere."""
    await nats_bus.consumer(ConsumerSpec("audit", nats_bus.subjects.trajectories))
    gen = episodic(nats_bus, make_engine("engine-0"), reply_timeout_s=3.0)
    doomed = await asyncio.to_thread(start_worker, nats_server.url, subjects.run, "env-0", 1.0)
    spare = None
    try:
        for i in range(6):
            await nats_bus.publish_event(nats_bus.subjects.requests(0), request(i))
        async with running(gen):
            assert gen.episodes is not None
            episodes = gen.episodes
            await until(lambda: sum(e.turns >= 1 for e in episodes.live.values()) >= 3, 60)
            doomed.send_signal(signal.SIGKILL)
            await asyncio.to_thread(doomed.wait)
            spare = await asyncio.to_thread(
                start_worker, nats_server.url, subjects.run, "env-1", 0.0
            )
            got = await collect(nats_bus, 6, timeout=120)
    finally:
        for proc in (doomed, spare):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert sorted(t.request.request_id for t in got) == sorted(f"g-{i}/0" for i in range(6))
    assert all(t.finish_reason == "stop" and t.error == "" for t in got)
    retried = [t for t in got if t.episode is not None and t.episode.attempts == 2]
    assert retried, "no episode was caught mid-step by the kill"
    assert all(t.episode is not None and t.episode.reward == 1.0 for t in got)
    assert gen.episodes.live == {} and not gen.core.held and not gen.core.opening


async def test_an_episode_handed_back_before_it_started_starts_again_at_once(
    nats_bus: NatsBus,
) -> None:
    """Reassigned while its environment was starting it, the generator hands the request
    back; pulled again, it starts on a fresh attempt (the first attempt's opening is stored
    under the same id, so a repeat would be dropped by the bus and wait out the timeout)."""
    await nats_bus.consumer(ConsumerSpec("audit", nats_bus.subjects.trajectories))
    engine = make_engine("engine-0")
    gen = episodic(nats_bus, engine, reply_timeout_s=300)
    opening = asyncio.Event()
    control = nats_bus.subjects.control("engine-0")
    await nats_bus.publish_event(nats_bus.subjects.requests(0), request(3))
    env = environment(nats_bus, lambda: Scripted(turns=2, opening=opening))
    async with env as host, running(gen):
        assert gen.episodes is not None
        await until(lambda: bool(gen.core.opening), 30)
        assign = AssignVersion(engine_id="engine-0", version=1)
        await nats_bus.request(control, assign.model_dump_json().encode())
        opening.set()  # the opening arrives for a version the engine no longer serves
        await until(lambda: not gen.core.opening and not gen.episodes.live, 30)
        back = AssignVersion(engine_id="engine-0", version=0)
        await nats_bus.request(control, back.model_dump_json().encode())
        (traj,) = await collect(nats_bus, 1, timeout=60)  # well inside reply_timeout_s
    assert traj.finish_reason == "stop" and traj.episode is not None
    assert traj.episode.attempts == 1 and traj.episode.reward == 2.0
    # each opening that was handed back had its own environment instance (closed when idle)
    assert host.stats.episodes >= 2
