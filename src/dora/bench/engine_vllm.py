"""vLLM's side of ``dora bench engine``: the same workloads through vLLM's offline ``LLM``.

Kept apart from the bench so the vLLM import (and its quirks) stays in one place; the bench
calls it only when ``import vllm`` works.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dora.bench.engine import Workload


def vllm_note() -> str | None:
    """None when vLLM imports, else why it is skipped."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # not installed, or no GPU build
        return f"skipped: import vllm failed ({type(exc).__name__})"
    return None


def run_vllm(directory: Path, work: Workload) -> float:
    """Seconds for vLLM offline generation of the workload (only where vLLM is installed)."""
    from vllm import LLM
    from vllm import SamplingParams as VSP

    llm = LLM(model=str(directory), dtype="float32", max_num_seqs=64)
    params = [
        VSP(temperature=1.0, max_tokens=n, ignore_eos=True, seed=i)
        for i, n in enumerate(work.lengths)
    ]
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    start = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - start
