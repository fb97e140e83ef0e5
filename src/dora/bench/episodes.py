"""``dora bench episodes``: does an engine keep decoding while episodes wait on slow tools?

Two workloads on one built-in engine (``--preset``, CPU), a real generator and a real
environment service on a real (embedded) nats-server, each for ``--seconds``:

- ``no_tools``: single-turn requests, ``--running`` of them decoding at once (the generator
  keeps the engine full);
- ``tools``: multi-turn episodes whose every tool call sleeps 2-5 s (uniform): a turn ends
  at ``#`` (the random tiny model writes one about every hundred tokens), the tool answers,
  the episode goes on for ``--turns`` turns. The generator holds up to ``--running`` decoding
  and ``--parked`` more parked on their tools (their KV kept).

Reported: the engine's sampled tokens/s over the window (after a warm-up), the mean number of
requests decoding and parked (sampled every 50 ms), and the ratio tools / no_tools. The goal
is >= 0.7 at 64 parked. What it does not show: prefill of long tool outputs (these replies are
a few tokens), or KV pressure (the engine has room for every parked episode).
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import typer

TOOL_MIN_S, TOOL_MAX_S = 2.0, 5.0
TURN_END = "#"


class SlowTool:
    """Every step sleeps 2-5 s, then answers; the episode ends after ``turns`` turns."""

    def __init__(self, turns: int, rng: random.Random) -> None:
        self.turns, self.rng, self.seen = turns, rng, 0

    async def reset(self, prompt: Any, seed: int) -> list[Any]:
        from dora.events import ChatMessage

        return [ChatMessage(role="user", content=prompt.text)]

    async def step(self, turn: Any) -> Any:
        from dora.envs import ChatMessage, StepResult

        await asyncio.sleep(self.rng.uniform(TOOL_MIN_S, TOOL_MAX_S))
        self.seen += 1
        if self.seen >= self.turns:
            return StepResult(done=True, reward=1.0)
        return StepResult(messages=[ChatMessage(role="tool", content=str(self.seen))])

    async def close(self) -> None:
        return None


def _request(i: int, max_tokens: int) -> Any:
    from dora.events import Prompt, RolloutRequest, SamplingParams

    return RolloutRequest(
        request_id=f"b{i}",
        prompt=Prompt(prompt_id=f"p{i}", text=f"Problem {i}:"),
        prompt_token_ids=(1, *range(40, 50)),
        group_id=f"g{i}",
        group_index=0,
        version=0,
        sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i),
    )


async def _workload(
    url: str,
    run: str,
    tools: bool,
    seconds: float,
    running: int,
    parked: int,
    turns: int,
    preset: str,
) -> dict[str, Any]:
    from dora.bus import NatsBus
    from dora.engines.torch import EngineConfig, TorchEngine
    from dora.envs.host import EnvironmentHost
    from dora.envs.service import EnvironmentService
    from dora.rollout.episodes import EpisodeConfig
    from dora.rollout.generator import Generator
    from dora.rollout.generator_config import GeneratorConfig
    from dora.subjects import Subjects

    async def no_weights(version: int) -> dict[str, Any]:
        return {}

    bus = NatsBus(Subjects(run), url)
    await bus.connect()
    config = EngineConfig(num_blocks=8192, max_num_seqs=running, max_num_batched_tokens=2048)
    engine = TorchEngine.from_preset(preset, seed=0, config=config, engine_id="engine-0")
    episodes = (
        EpisodeConfig(environment="slow", turn_stop_strings=(TURN_END,), reply_timeout_s=60)
        if tools
        else None
    )
    generator = Generator(
        engine,
        bus,
        no_weights,
        GeneratorConfig(
            engine_id="engine-0",
            initial_version=0,
            max_running=running,
            max_parked=parked if tools else 0,
            episodes=episodes,
        ),
    )
    rng = random.Random(0)
    service = EnvironmentService(
        EnvironmentHost("env-0", "slow", lambda: SlowTool(turns, rng)), bus, concurrency=512
    )
    need = int(seconds * 40) + 4 * (running + parked)
    for i in range(need):  # more than the window can take: the engine never starves
        await bus.publish_event(bus.subjects.requests(0), _request(i, 2000 if tools else 400))
    tasks = [asyncio.create_task(service.run()), asyncio.create_task(generator.run())]
    await generator.ready.wait()
    samples: list[tuple[int, int]] = []
    try:
        await asyncio.sleep(min(10.0, seconds / 3))  # warm up: episodes reach their tools
        start_tokens, t0 = engine.counters.generated_tokens, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            await asyncio.sleep(0.05)
            parked_now = len(generator.core.parked)
            samples.append((len(generator.core.held) - parked_now, parked_now))
        elapsed = time.perf_counter() - t0
        tokens = engine.counters.generated_tokens - start_tokens
    finally:
        generator.stop()
        service.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        await bus.close()
    return {
        "workload": "tools" if tools else "no_tools",
        "preset": preset,
        "tokens_per_s": round(tokens / elapsed, 1),
        "decoding_mean": round(sum(d for d, _ in samples) / len(samples), 1),
        "parked_mean": round(sum(p for _, p in samples) / len(samples), 1),
        "seconds": round(elapsed, 1),
    }


def measure(
    url: str, seconds: float, running: int, parked: int, turns: int, preset: str
) -> list[dict]:
    rows = []
    for i, tools in enumerate((False, True)):
        run = f"benche{i}"
        rows.append(
            asyncio.run(_workload(url, run, tools, seconds, running, parked, turns, preset))
        )
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["ratio_to_no_tools"] = round(row["tokens_per_s"] / base, 3) if base else None
    return rows


def cli(
    seconds: float = typer.Option(60.0, "--seconds", min=5, help="Measured window per workload."),
    running: int = typer.Option(16, "--running", min=1, help="Requests decoding at once."),
    parked: int = typer.Option(64, "--parked", min=0, help="Episodes parked on tools, at most."),
    turns: int = typer.Option(4, "--turns", min=2, help="Assistant turns per episode."),
    threads: int = typer.Option(1, "--threads", min=1, help="torch threads."),
    preset: str = typer.Option("tiny", "--preset", help="Model preset of the engine."),
    results_dir: Path = typer.Option(Path("runs/bench"), "--results-dir"),
) -> None:
    """Engine tokens/s with episodes parked on 2-5 s tools, against no tools (table + JSON)."""
    import torch

    from dora.bench.report import print_table, save_rows
    from dora.bus.server import NatsServer
    from dora.logs import configure

    configure(None, "warning")
    torch.set_num_threads(threads)
    with (
        tempfile.TemporaryDirectory(prefix="dora-bench-episodes-") as tmp,
        NatsServer(Path(tmp)) as server,
    ):
        rows = measure(server.url, seconds, running, parked, turns, preset)
    print_table("dora bench episodes: engine tokens/s while episodes wait on 2-5 s tools", rows)
    meta = {
        "seconds": seconds,
        "running": running,
        "parked": parked,
        "turns": turns,
        "preset": preset,
    }
    path = save_rows("episodes", rows, meta=meta, results_dir=results_dir)
    typer.echo(f"saved {path}")
