"""Prompt sources: synthetic tasks with long-tailed lengths and local math datasets.

Stable API::

    make_task(name, **config) -> Task      # arithmetic, chain, tally, countdown, jsonl (= dataset)
    task.prompt(split, index) -> Prompt    # deterministic by (seed, split, index)
    task.prompts(split, count, start=0) -> Iterator[Prompt]
    task.solve(prompt) -> str              # a correct reference completion

Configs are pydantic models (``ArithmeticConfig``, ``CountdownConfig``, ``DatasetConfig``);
a bad field raises ``TaskConfigError`` naming it.
"""

from dora.tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from dora.tasks.base import (
    SPLITS,
    BaseTask,
    Split,
    Task,
    TaskConfig,
    TaskConfigError,
    make_task,
    register_task,
    task_names,
)
from dora.tasks.chain import ChainConfig, ChainTask
from dora.tasks.countdown import CountdownConfig, CountdownTask
from dora.tasks.dataset import DatasetConfig, DatasetTask, read_rows, sample_path
from dora.tasks.retail import RetailConfig, RetailTask
from dora.tasks.tally import TallyConfig, TallyTask

register_task("arithmetic", ArithmeticConfig, ArithmeticTask)
register_task("chain", ChainConfig, ChainTask)
register_task("countdown", CountdownConfig, CountdownTask)
register_task("tally", TallyConfig, TallyTask)
register_task("jsonl", DatasetConfig, DatasetTask)
register_task("dataset", DatasetConfig, DatasetTask)

register_task("retail", RetailConfig, RetailTask)

__all__ = [
    "SPLITS",
    "ArithmeticConfig",
    "ArithmeticTask",
    "BaseTask",
    "ChainConfig",
    "ChainTask",
    "CountdownConfig",
    "CountdownTask",
    "DatasetConfig",
    "DatasetTask",
    "RetailConfig",
    "RetailTask",
    "Split",
    "TallyConfig",
    "TallyTask",
    "Task",
    "TaskConfig",
    "TaskConfigError",
    "make_task",
    "read_rows",
    "register_task",
    "sample_path",
    "task_names",
]
