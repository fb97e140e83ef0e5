"""Math datasets from local JSONL or Parquet files in the DAPO-Math-17K (verl) layout.

A DAPO row looks like ``{"data_source": "math_dapo", "prompt": [{"role": "user", "content":
"..."}], "ability": "MATH", "reward_model": {"ground_truth": "34", "style": "rule-based"},
"extra_info": {"index": "..."}}``. Flat rows (``{"prompt": "...", "answer": "..."}``) work
too. Every row must yield a prompt and an answer: a bad row is an error naming the row and the
field, never silently skipped. The train/eval split is a seeded permutation of the rows.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from dora.events import Prompt
from dora.tasks.base import BaseTask, Split, TaskConfig, TaskConfigError, check_split, rng_for

ANSWER_KEYS = ("reward_model.ground_truth", "answer", "ground_truth", "solution", "target")
ID_KEYS = ("extra_info.index", "id", "uid", "index")


def sample_path() -> Path:
    """The bundled 20-problem sample in DAPO layout (JSONL)."""
    return Path(str(resources.files("dora") / "data" / "math_sample.jsonl"))


class DatasetConfig(TaskConfig):
    """Where the rows are and which fields hold the prompt and the answer."""

    path: str = Field(min_length=1, description="A .jsonl/.json or .parquet file.")
    format: Literal["auto", "jsonl", "parquet"] = "auto"
    prompt_key: str = "prompt"
    answer_key: str | None = Field(default=None, description=f"Dotted path; default {ANSWER_KEYS}")
    eval_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)
    eval_size: int | None = Field(default=None, ge=0)
    task: str = Field(default="math", min_length=1, description="Prompt.task (picks verifier).")

    @field_validator("path")
    @classmethod
    def _exists(cls, value: str) -> str:
        if not Path(value).is_file():
            raise ValueError(f"no such file: {value}")
        return value


def read_rows(path: Path, fmt: str = "auto") -> list[dict[str, Any]]:
    """Rows of a JSONL or Parquet file as dicts (nested structs stay nested)."""
    if fmt == "auto":
        fmt = "parquet" if path.suffix == ".parquet" else "jsonl"
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskConfigError(f"{path}:{lineno}: invalid JSON: {exc}") from exc
        if not isinstance(row, dict):
            raise TaskConfigError(f"{path}:{lineno}: a row must be a JSON object")
        rows.append(row)
    return rows


def lookup(row: dict[str, Any], dotted: str) -> Any:
    """``row["a"]["b"]`` for ``"a.b"``; None when any part is missing."""
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def prompt_text(value: Any) -> str | None:
    """A prompt string from a plain string or a chat message list (user turns joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        user = [str(m.get("content", "")) for m in value if m.get("role", "user") == "user"]
        return "\n\n".join(user) if user else None
    return None


class DatasetTask(BaseTask):
    """Prompts from a math dataset file; eval rows are a seeded random subset."""

    name = "jsonl"

    def __init__(self, config: DatasetConfig) -> None:
        self.config = config
        self.rows = self._load()
        order = list(range(len(self.rows)))
        rng_for("dataset", config.seed, len(self.rows)).shuffle(order)
        n_eval = config.eval_size
        if n_eval is None:
            n_eval = round(len(self.rows) * config.eval_fraction)
            if config.eval_fraction > 0 and len(self.rows) > 1:
                n_eval = max(1, n_eval)
        if n_eval >= len(self.rows):
            raise TaskConfigError(f"eval_size {n_eval} leaves no train rows of {len(self.rows)}")
        self.split_rows: dict[str, list[int]] = {
            "eval": [int(i) for i in order[:n_eval]],
            "train": [int(i) for i in order[n_eval:]],
            "dev": [],  # a file's rows are split in two; tune on a split of your own file
        }

    def _load(self) -> list[tuple[str, str, str, str]]:
        c = self.config
        path = Path(c.path)
        out = []
        for n, row in enumerate(read_rows(path, c.format)):
            text = prompt_text(lookup(row, c.prompt_key))
            if not text:
                raise TaskConfigError(f"{path} row {n}: no prompt text at {c.prompt_key!r}")
            keys = (c.answer_key,) if c.answer_key else ANSWER_KEYS
            answer = next((lookup(row, k) for k in keys if lookup(row, k) is not None), None)
            if answer is None or str(answer) == "":
                raise TaskConfigError(f"{path} row {n}: no answer at any of {list(keys)}")
            row_id = next((lookup(row, k) for k in ID_KEYS if lookup(row, k) is not None), n)
            source = str(row.get("data_source", "") or "")
            out.append((text, str(answer), str(row_id), source))
        if len(out) < 2:
            raise TaskConfigError(f"{path}: need at least 2 rows, found {len(out)}")
        return out

    def size(self, split: Split) -> int:
        """Rows in a split (``prompt`` wraps around beyond it: index ``size`` is epoch 1)."""
        return len(self.split_rows[check_split(split)])

    def prompt(self, split: Split, index: int) -> Prompt:
        """Row ``index mod size`` of the split."""
        rows = self.split_rows[check_split(split)]
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        if not rows:
            raise TaskConfigError(f"split {split!r} is empty")
        epoch, pos = divmod(index, len(rows))
        text, answer, row_id, source = self.rows[rows[pos]]
        return Prompt(
            prompt_id=f"{self.config.task}-s{self.config.seed}-{split}-{index}",
            text=text,
            answer=answer,
            task=self.config.task,
            split=split,
            metadata={"row_id": row_id, "data_source": source, "epoch": epoch},
        )

    def solve(self, prompt: Prompt) -> str:
        """A minimal correct completion: the ground truth in ``\\boxed{}``."""
        return f"The answer is $\\boxed{{{prompt.answer}}}$."
