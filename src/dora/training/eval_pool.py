"""Several policies' eval passes at once, on a pool of processes.

One pass of the tiny model's decode uses one core: its step is Python and small matmuls, so
two torch threads are no faster than one (59.6 s with two, 60.4 s with one, for the
quickstart's greedy pass), while two one-thread processes side by side take 62-64 s each.
The learner scores the start and final policies, greedy and sampled (four passes), so on two
cores a pool of two halves the evaluation. Each pass is a pure function of the policy's
directory and the frozen set, so a worker rebuilds both from their descriptions and returns
plain lists.

Stopping: workers ignore SIGINT (a terminal sends it to the whole process group; the parent
decides) and die with the thread that started them; the parent polls ``interrupt.check()``
between results and terminates the pool when the user stops the run.
"""

from __future__ import annotations

import multiprocessing
import signal
from pathlib import Path
from typing import Any

from dora import interrupt
from dora.tasks.evalset import EvalSetSpec
from dora.training.evaluate import Pass

POLL_S = 0.2


def _init_worker() -> None:
    import torch

    from dora.bus.server import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    torch.set_num_threads(1)


def _run_pass(
    directory: str,
    task_name: str,
    task_config: dict[str, Any],
    spec: dict[str, Any],
    which: Pass,
    samples: int,
    seed: int,
) -> dict[str, list[float]]:
    from dora.models import load_pretrained, load_tokenizer
    from dora.tasks import make_task
    from dora.tasks.evalset import EvalSetSpec, build_eval_set
    from dora.training.evaluate import score_pass

    task = make_task(task_name, **task_config)
    eval_set = build_eval_set(task, EvalSetSpec.model_validate(spec))
    model, tokenizer = load_pretrained(Path(directory)), load_tokenizer(Path(directory))
    return score_pass(model, tokenizer, task, eval_set, which, samples, seed)


def score_policies(
    directories: dict[str, Path],
    task_name: str,
    task_config: dict[str, Any],
    spec: EvalSetSpec,
    samples: int = 0,
    seed: int = 0,
    workers: int = 2,
) -> dict[str, dict[str, list[float]]]:
    """``score_eval_set`` of each named policy directory (its greedy pass, and its sampled
    pass when ``samples`` > 0), the passes spread over ``workers`` processes (1: here)."""
    passes: tuple[Pass, ...] = ("greedy", "sampled") if samples else ("greedy",)
    jobs = [(name, which) for name in directories for which in passes]
    args = {
        (name, which): (
            str(directories[name]),
            task_name,
            task_config,
            spec.model_dump(),
            which,
            samples,
            seed,
        )
        for name, which in jobs
    }
    done: dict[tuple[str, Pass], dict[str, list[float]]] = {}
    if workers <= 1 or len(jobs) == 1:
        for job in jobs:
            interrupt.check()
            done[job] = _run_pass(*args[job])
    else:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads, sockets
        pool = ctx.Pool(min(workers, len(jobs)), initializer=_init_worker)
        try:
            pending = {job: pool.apply_async(_run_pass, args[job]) for job in jobs}
            while pending:
                interrupt.check()
                for job, result in list(pending.items()):
                    if result.ready():
                        done[job] = result.get()
                        del pending[job]
                if pending:
                    next(iter(pending.values())).wait(POLL_S)
            pool.close()
        finally:
            pool.terminate()  # the workers are done (close) or abandoned (an error, a stop)
            pool.join()
    results: dict[str, dict[str, list[float]]] = {name: {} for name in directories}
    for job in jobs:  # in job order: greedy, then sampled, as score_eval_set has them
        results[job[0]].update(done[job])
    return results
