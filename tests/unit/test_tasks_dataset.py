"""DAPO-layout math datasets from JSONL and Parquet (the bundled sample)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dora.rewards import make_verifier
from dora.tasks import TaskConfigError, make_task, read_rows, sample_path


def test_bundled_sample_jsonl() -> None:
    rows = read_rows(sample_path())
    assert len(rows) >= 20
    assert rows[0]["reward_model"]["ground_truth"] and rows[0]["prompt"][0]["role"] == "user"
    task = make_task("jsonl", path=str(sample_path()), seed=1, eval_fraction=0.25)
    n_train, n_eval = task.size("train"), task.size("eval")  # type: ignore[attr-defined]
    assert n_train + n_eval == len(rows) and n_eval == round(len(rows) * 0.25)
    train = {p.metadata["row_id"] for p in task.prompts("train", n_train)}
    evals = {p.metadata["row_id"] for p in task.prompts("eval", n_eval)}
    assert not train & evals and len(train | evals) == len(rows)
    again = make_task("jsonl", path=str(sample_path()), seed=1, eval_fraction=0.25)
    assert [p.text for p in again.prompts("eval", n_eval)] == [
        p.text for p in task.prompts("eval", n_eval)
    ]
    wrapped = task.prompt("train", n_train)  # next epoch
    assert wrapped.text == task.prompt("train", 0).text and wrapped.metadata["epoch"] == 1
    p = task.prompt("eval", 0)
    assert p.task == "math" and "Answer:" in p.text and p.answer
    verifier = make_verifier("math")
    for prompt in task.prompts("train", n_train):
        assert verifier.verify(task.solve(prompt), prompt).correct


def test_parquet_nested_and_flat_layouts(tmp_path: Path) -> None:
    rows = read_rows(sample_path())
    nested = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(rows), nested)
    a = make_task("dataset", path=str(nested), seed=0)
    b = make_task("jsonl", path=str(sample_path()), seed=0)
    assert [(p.text, p.answer) for p in a.prompts("eval", 2)] == [
        (p.text, p.answer) for p in b.prompts("eval", 2)
    ]
    flat = tmp_path / "flat.jsonl"
    flat.write_text(
        "\n".join(json.dumps({"prompt": f"{i}+1?", "answer": str(i + 1)}) for i in range(5))
    )
    task = make_task("jsonl", path=str(flat), eval_size=1, task="math")
    assert task.size("eval") == 1  # type: ignore[attr-defined]
    p = task.prompt("train", 0)
    assert p.answer == str(int(p.text.split("+")[0]) + 1)


def test_bad_rows_and_config_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": "1"}\n{"prompt": "y"}\n')
    with pytest.raises(TaskConfigError, match="row 1: no answer"):
        make_task("jsonl", path=str(bad))
    with pytest.raises(TaskConfigError, match="path"):
        make_task("jsonl", path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(TaskConfigError, match="eval_fraction"):
        make_task("jsonl", path=str(sample_path()), eval_fraction=1.5)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(TaskConfigError, match=r"broken\.jsonl:1"):
        make_task("jsonl", path=str(broken))
