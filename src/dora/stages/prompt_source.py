"""A finite source of task prompts (``dora.tasks``) with deterministic event ids."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dora.events import Event, Prompt
from dora.stage import Context, Stage, derived_id
from dora.subjects import source_progress_key
from dora.tasks import Task, make_task


class PromptSourceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str = Field(default="arithmetic", description="A dora.tasks name.")
    task_config: dict[str, Any] = Field(default_factory=dict, description="make_task kwargs.")
    split: Literal["train", "dev", "eval"] = "train"
    count: int = Field(default=16, ge=0, description="How many prompts, then the source ends.")
    start: int = Field(default=0, ge=0, description="Index of the first prompt.")

    @model_validator(mode="after")
    def _task_builds(self) -> PromptSourceConfig:
        make_task(self.task, **self.task_config)  # TaskConfigError names the bad field
        return self


class PromptSource(Stage):
    """Publishes ``count`` prompts of a task to ``prompts``, then completes.

    Event ids derive from the prompt id, so a restarted source republishes nothing new, and
    its position is kept in the KV store (``source.<name>``), so a resumed run continues
    after the last prompt it published instead of starting over.
    """

    name = "prompts"
    emits = {Prompt: "prompts"}
    kv_writes = ("source.{name}",)  # how far it got, for a resumed run
    finite = True
    Config = PromptSourceConfig

    async def setup(self, ctx: Context) -> None:
        self.task: Task = make_task(self.config.task, **self.config.task_config)

    async def produce(self, ctx: Context) -> AsyncIterator[Event]:
        key = source_progress_key(self.name)
        raw = await ctx.bus.kv_get(key)
        done = int(raw) if raw else 0  # a resumed run continues where the source stopped
        start, count = self.config.start + done, self.config.count - done
        for i, prompt in enumerate(self.task.prompts(self.config.split, max(count, 0), start)):
            yield prompt.model_copy(update={"event_id": derived_id("prompt", prompt.prompt_id)})
            if (done + i + 1) % 16 == 0 or i + 1 == count:
                await ctx.bus.kv_put(key, str(done + i + 1).encode())

    def progress_total(self) -> int | None:
        return self.config.count
