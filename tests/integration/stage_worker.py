"""Stages used by subprocess tests (``dora run`` on a pipeline that names them by path)."""

from __future__ import annotations

import asyncio

from pydantic import Field

from dora.events import Prompt, Trajectory
from dora.stage import Context
from dora.stages.rule_generator import RuleGenerator, RuleGeneratorConfig


class SlowConfig(RuleGeneratorConfig):
    delay_s: float = Field(default=0.0, ge=0.0)


class SlowGenerator(RuleGenerator):
    """The rule generator, slowed down so that a test can kill it mid-run."""

    Config = SlowConfig

    async def handle(self, prompt: Prompt, ctx: Context) -> Trajectory:
        await asyncio.sleep(self.config.delay_s)
        return await super().handle(prompt, ctx)
