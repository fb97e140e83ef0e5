"""Stages used by subprocess tests (``dora run`` on a pipeline that names them by path).

Kept free of torch (no tokenizer model) so that a worker process starts fast.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, ConfigDict, Field

from dora.events import Prompt, RolloutRequest, Trajectory
from dora.stage import Context, Stage, derived_id


class SlowConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    delay_s: float = Field(default=0.0, ge=0.0)


class SlowGenerator(Stage):
    """Prompt -> Trajectory (bytes as tokens), slowed down so a test can kill it mid-run.

    The output id derives from the input id: a redelivered prompt republishes the same id.
    """

    name = "generator"
    consumes = "prompts"
    emits = {Trajectory: "trajectories"}
    Config = SlowConfig

    async def handle(self, prompt: Prompt, ctx: Context) -> Trajectory:
        await asyncio.sleep(self.config.delay_s)
        completion = f"answer: {prompt.answer}"
        tokens = tuple(completion.encode())
        request = RolloutRequest(
            request_id=prompt.prompt_id,
            prompt=prompt,
            group_id=prompt.prompt_id,
            group_index=0,
            version=0,
        )
        return Trajectory(
            event_id=derived_id(prompt.event_id, "trajectory"),
            request=request,
            version=0,
            prompt_token_ids=tuple(prompt.text.encode()),
            completion_token_ids=tokens,
            logprobs=(0.0,) * len(tokens),
            loss_mask=(1,) * len(tokens),
            text=completion,
            finish_reason="stop",
        )
