"""An environment replica in its own process, for crash tests: ``python -m
tests.integration.env_worker URL RUN OWNER DELAY_S``. Its episodes end after three turns;
each step takes DELAY_S (a slow tool), so a test can kill it mid-episode."""

from __future__ import annotations

import asyncio
import sys

from dora.bus import NatsBus
from dora.envs import AssistantTurn, ChatMessage, StepResult
from dora.envs.host import EnvironmentHost
from dora.envs.service import EnvironmentService
from dora.events import Prompt
from dora.subjects import Subjects


class SlowTool:
    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.turns = delay_s, 0

    async def reset(self, prompt: Prompt, seed: int) -> list[ChatMessage]:
        return [ChatMessage(role="user", content=prompt.text)]

    async def step(self, turn: AssistantTurn) -> StepResult:
        await asyncio.sleep(self.delay_s)
        self.turns += 1
        if self.turns >= 3:
            return StepResult(done=True, reward=1.0)
        return StepResult(messages=[ChatMessage(role="tool", content=f"<r>{self.turns}</r>")])

    async def close(self) -> None:
        return None


async def main(url: str, run: str, owner: str, delay_s: float) -> None:
    bus = NatsBus(Subjects(run), url)
    await bus.connect()
    host = EnvironmentHost(owner, "scripted", lambda: SlowTool(delay_s))
    service = EnvironmentService(host, bus)
    task = asyncio.create_task(service.run())
    await service.ready.wait()
    print("ready", flush=True)
    await task


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))
