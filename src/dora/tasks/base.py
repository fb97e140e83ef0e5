"""The Task protocol, deterministic per-split seeding, and the task registry.

A task is a pure function of ``(seed, split, index)``: the same config always yields the same
prompt, on any machine, so a restarted prompt source replays exactly what it produced before.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict

from dora.events import Prompt
from dora.named import Named

Split = Literal["train", "dev", "eval"]
SPLITS: tuple[Split, ...] = ("train", "dev", "eval")


class TaskConfigError(ValueError):
    """A task name or configuration that cannot be used (the message names the field)."""


class TaskConfig(BaseModel):
    """Fields every task accepts; subclasses add their own. Unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0


@runtime_checkable
class Task(Protocol):
    """A source of verifiable prompts with a reference solver."""

    name: str

    def prompt(self, split: Split, index: int) -> Prompt: ...

    def prompts(self, split: Split, count: int, start: int = 0) -> Iterator[Prompt]: ...

    def solve(self, prompt: Prompt) -> str: ...


def check_split(split: str) -> Split:
    """Refuse anything but ``train``/``eval`` with a clear message."""
    if split not in SPLITS:
        raise TaskConfigError(f"split must be one of {SPLITS}, got {split!r}")
    return split  # type: ignore[return-value]


def rng_for(*parts: object) -> random.Random:
    """A generator seeded by a stable hash of ``parts`` (not Python's salted ``hash``)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:16], "little"))


def split_of(key: str, eval_percent: int, dev_percent: int = 0) -> Split:
    """Which split a problem belongs to, by a stable hash of its identity.

    Assigning problems (not indices) to splits makes train, dev and eval disjoint by
    construction, whatever the seed or the number of prompts drawn. ``key`` must be the same for
    every rendering of one problem (e.g. the sorted terms of a sum), so that a permutation of a
    training problem never lands in eval.
    """
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") % 100
    if bucket < eval_percent:
        return "eval"
    return "dev" if bucket < eval_percent + dev_percent else "train"


class BaseTask:
    """Shared plumbing: ``prompts`` over ``prompt`` and prompt ids."""

    name: str = "task"

    def prompt(self, split: Split, index: int) -> Prompt:  # pragma: no cover - abstract
        raise NotImplementedError

    def solve(self, prompt: Prompt) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def prompts(self, split: Split, count: int, start: int = 0) -> Iterator[Prompt]:
        """``count`` consecutive prompts of a split, from index ``start``."""
        check_split(split)
        if count < 0 or start < 0:
            raise TaskConfigError(f"count and start must be >= 0, got {count=} {start=}")
        for i in range(start, start + count):
            yield self.prompt(split, i)

    def prompt_id(self, seed: int, split: Split, index: int) -> str:
        return f"{self.name}-s{seed}-{split}-{index}"


TaskFactory = Callable[..., Task]
_TASKS: Named[Task] = Named("task", TaskConfigError)
C = TypeVar("C", bound=TaskConfig)


def register_task(
    name: str, config_cls: type[C], factory: Callable[[C], Task], *, replace: bool = False
) -> None:
    """Make ``make_task(name, **config)`` build ``factory(config_cls(**config))``."""
    _TASKS.register(name, config_cls, factory, replace=replace)


def task_names() -> list[str]:
    """Names ``make_task`` accepts."""
    return _TASKS.names()


def make_task(name: str, **config: Any) -> Task:
    """Build a registered task from keyword config (validated; bad fields are named)."""
    return _TASKS.make(name, **config)
