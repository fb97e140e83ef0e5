"""The eval passes on a pool of real processes: the same scores as in one process, and a stop
request ends the pool's workers."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import pytest

from dora import interrupt
from dora.models import build_model, load_pretrained, load_tokenizer, save_pretrained
from dora.tasks import make_task
from dora.tasks.evalset import EvalSetSpec, build_eval_set
from dora.training.eval_pool import score_policies
from dora.training.evaluate import score_eval_set

TASK = {"max_terms": 4}


def policies(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for name, seed in (("start", 1), ("final", 2)):
        model, tok = build_model("tiny", seed=seed, num_hidden_layers=1)
        out[name] = save_pretrained(model, tmp_path / name, tok)
    return out


def test_pooled_passes_score_as_one_process_does(tmp_path: Path) -> None:
    dirs = policies(tmp_path)
    spec = EvalSetSpec(strata=[[3, 3], [4, 4]], per_stratum=4)
    pooled = score_policies(dirs, "arithmetic", TASK, spec, samples=2, workers=2)
    task = make_task("arithmetic", **TASK)
    eval_set = build_eval_set(task, spec)
    for name, directory in dirs.items():
        model = load_pretrained(directory)
        alone = score_eval_set(model, load_tokenizer(directory), task, eval_set, samples=2)
        assert pooled[name] == alone
        assert list(pooled[name]) == ["greedy", "greedy_length", "avg@2"]
    assert multiprocessing.active_children() == []


def test_a_stop_request_ends_the_pool(tmp_path: Path) -> None:
    dirs = policies(tmp_path)
    spec = EvalSetSpec(strata=[[2, 4]], per_stratum=300)  # passes of many seconds
    started = threading.Event()

    def stop_when_workers_run() -> None:
        while not multiprocessing.active_children():
            if started.wait(0.05):
                return
        interrupt.request()

    watcher = threading.Thread(target=stop_when_workers_run)
    watcher.start()
    try:
        with pytest.raises(interrupt.Interrupted):
            score_policies(dirs, "arithmetic", TASK, spec, samples=4, workers=2)
    finally:
        started.set()
        watcher.join()
        interrupt.clear()
    assert multiprocessing.active_children() == []
