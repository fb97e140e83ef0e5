"""Score trajectories concurrently; a verifier failure costs a reward, never a trajectory.

The verifier is picked by ``prompt.task``. Heavy verifiers (``heavy = True``, e.g. math) run in
a process pool so sympy cannot block the event loop and a hung check can be killed; light ones
run in a thread. Each check has a timeout; a crash or timeout yields reward 0 with the error
recorded in ``ScoredTrajectory.error``. The service knows nothing of the bus: a stage wraps it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Iterable, Mapping
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import structlog

from dora.events import Prompt, ScoredTrajectory, Trajectory
from dora.rewards.base import Verifier, VerifierError, VerifierResult, make_verifier
from dora.rewards.shaping import OverlongShaping

log = structlog.get_logger(__name__)

DEFAULT_TASK_VERIFIERS: dict[str, str] = {
    "arithmetic": "exact_match",
    "chain": "exact_match",
    "tally": "exact_match",
    "countdown": "countdown",
    "math": "math",
    "jsonl": "math",
    "dataset": "math",
}


def _run_verify(verifier: Verifier, completion: str, prompt: Prompt) -> VerifierResult:
    """Worker entry point (module level so it pickles)."""
    return verifier.verify(completion, prompt)


def _clean(details: Mapping[str, Any]) -> dict[str, str | int | float | bool]:
    return {
        str(k): v if isinstance(v, str | int | float | bool) else str(v) for k, v in details.items()
    }


class RewardService:
    """Concurrent, crash-proof scoring of trajectories (bus-free)."""

    def __init__(
        self,
        task_verifiers: Mapping[str, str | Verifier] | None = None,
        *,
        default_verifier: str | Verifier | None = None,
        timeout_s: float = 10.0,
        max_workers: int = 2,
        overlong: OverlongShaping | None = None,
        use_processes: bool = True,
        mp_context: str = "fork",
        tokenizer: Any = None,
    ) -> None:
        if timeout_s <= 0:
            raise VerifierError(f"timeout_s must be > 0, got {timeout_s}")
        self.task_verifiers: dict[str, str | Verifier] = dict(
            DEFAULT_TASK_VERIFIERS if task_verifiers is None else task_verifiers
        )
        self.default_verifier = default_verifier
        self.timeout_s = timeout_s
        self.max_workers = max_workers
        self.overlong = overlong
        self.use_processes = use_processes
        self.mp_context = mp_context
        self.tokenizer = tokenizer
        self._verifiers: dict[str, Verifier] = {}
        self._procs: ProcessPoolExecutor | None = None
        self._threads = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="verify")

    # ---------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> RewardService:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker pools (running checks are abandoned)."""
        self._kill_procs()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _kill_procs(self) -> None:
        pool, self._procs = self._procs, None
        if pool is None:
            return
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.kill()  # a hung sympy call ignores everything else
        pool.shutdown(wait=False, cancel_futures=True)

    def _proc_pool(self) -> ProcessPoolExecutor:
        if self._procs is None:
            ctx = multiprocessing.get_context(self.mp_context)
            self._procs = ProcessPoolExecutor(max_workers=self.max_workers, mp_context=ctx)
        return self._procs

    # ---------------------------------------------------------------- scoring

    def verifier_for(self, task: str) -> Verifier:
        """The verifier of a task (built once); VerifierError when none is configured."""
        spec = self.task_verifiers.get(task, self.default_verifier)
        if spec is None:
            raise VerifierError(
                f"no verifier for task {task!r}; configured tasks: {sorted(self.task_verifiers)}"
            )
        if not isinstance(spec, str):
            return spec
        if spec not in self._verifiers:
            self._verifiers[spec] = make_verifier(spec)
        return self._verifiers[spec]

    def _completion_text(self, trajectory: Trajectory) -> str:
        if trajectory.text or not trajectory.completion_token_ids or self.tokenizer is None:
            return trajectory.text
        return str(self.tokenizer.decode(trajectory.completion_token_ids))

    async def _check(self, verifier: Verifier, completion: str, prompt: Prompt) -> VerifierResult:
        loop = asyncio.get_running_loop()
        heavy = self.use_processes and bool(getattr(verifier, "heavy", False))
        for attempt in range(2):
            pool: Executor = self._proc_pool() if heavy else self._threads
            future = loop.run_in_executor(pool, _run_verify, verifier, completion, prompt)
            try:
                return await asyncio.wait_for(future, self.timeout_s)
            except TimeoutError:
                if heavy and pool is self._procs:
                    self._kill_procs()  # the worker may be stuck; start afresh
                raise
            except BrokenProcessPool:
                # Another item's timeout (or a worker crash) killed the pool: retry once.
                if pool is self._procs:
                    self._kill_procs()
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def score(self, trajectory: Trajectory) -> ScoredTrajectory:
        """Reward one trajectory; errors become reward 0 with ``error`` set."""
        prompt = trajectory.request.prompt
        length = len(trajectory.completion_token_ids)
        name = ""
        try:
            verifier = self.verifier_for(prompt.task)
            name = getattr(verifier, "name", type(verifier).__name__)
            result = await self._check(verifier, self._completion_text(trajectory), prompt)
        except TimeoutError:
            error = f"verifier {name!r} timed out after {self.timeout_s}s"
            return self._failed(trajectory, name, error)
        except Exception as exc:  # a verifier bug must not lose the trajectory
            return self._failed(trajectory, name, f"{type(exc).__name__}: {exc}")
        reward = float(result.reward)
        details = _clean(result.details)
        if self.overlong is not None:
            reward, extra = self.overlong.apply(reward, length)
            details.update(extra)
        return ScoredTrajectory(
            trajectory=trajectory,
            reward=reward,
            correct=bool(result.correct),
            verifier=name,
            details=details,
        )

    def _failed(self, trajectory: Trajectory, name: str, error: str) -> ScoredTrajectory:
        log.warning(
            "verifier_failed", request_id=trajectory.request.request_id, verifier=name, error=error
        )
        return ScoredTrajectory(
            trajectory=trajectory, reward=0.0, correct=False, verifier=name, error=error[:2000]
        )

    async def score_many(self, trajectories: Iterable[Trajectory]) -> list[ScoredTrajectory]:
        """Score several trajectories concurrently, results in input order."""
        return list(await asyncio.gather(*(self.score(t) for t in trajectories)))
