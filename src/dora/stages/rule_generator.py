"""PLACEHOLDER generator: answers each prompt with the task's reference solution.

It stands where the real rollout engines go (versioned generators behind a dispatcher, later
issues); it exists so a pipeline runs end to end without a model. Tokens come from the
``CharTokenizer``; logprobs are 0 (the "policy" is deterministic).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from dora.events import Prompt, RolloutRequest, Timings, Trajectory, now
from dora.models import CharTokenizer
from dora.stage import Context, Stage, derived_id
from dora.tasks import Task, make_task


class RuleGeneratorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    corrupt_every: int = Field(
        default=0, ge=0, description="Answer every k-th prompt wrongly (0: never), for demos."
    )
    version: int = Field(default=0, ge=0, description="Policy version written on trajectories.")


class RuleGenerator(Stage):
    """Prompt -> Trajectory by ``Task.solve`` (placeholder for the engines)."""

    name = "generator"
    consumes = "prompts"
    emits = {Trajectory: "trajectories"}
    concurrency = 4
    Config = RuleGeneratorConfig

    async def setup(self, ctx: Context) -> None:
        self.tokenizer = CharTokenizer.build()
        self.tasks: dict[str, Task] = {}

    def _task(self, name: str) -> Task:
        if name not in self.tasks:
            self.tasks[name] = make_task(name)
        return self.tasks[name]

    async def handle(self, prompt: Prompt, ctx: Context) -> Trajectory:
        started = now()
        completion = self._task(prompt.task).solve(prompt)
        every = self.config.corrupt_every
        if every and int(derived_id(prompt.prompt_id), 16) % every == 0:
            completion += "1"  # deliberately wrong final answer
        tok = self.tokenizer
        prompt_ids = tuple(tok.encode(prompt.text, add_bos=True))
        completion_ids = tuple(tok.encode(completion, add_eos=True))
        request = RolloutRequest(
            event_id=derived_id(prompt.event_id, "request"),
            request_id=prompt.prompt_id,
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            group_id=prompt.prompt_id,
            group_index=0,
            version=self.config.version,
            dispatched_at=started,
        )
        finished = now()
        return Trajectory(
            event_id=derived_id(prompt.event_id, "trajectory"),
            request=request,
            version=self.config.version,
            prompt_token_ids=prompt_ids,
            completion_token_ids=completion_ids,
            logprobs=(0.0,) * len(completion_ids),
            loss_mask=(1,) * len(completion_ids),
            text=completion,
            finish_reason="stop",
            engines=(f"rule-{ctx.stage.name}",),
            timings=Timings(
                dispatched_at=started,
                started_at=started,
                first_token_at=finished,
                finished_at=finished,
                decode_s=finished - started,
            ),
        )
