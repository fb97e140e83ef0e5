"""vLLM's side of ``dora bench engine``: the same workloads through vLLM's offline ``LLM``.

Kept apart from the bench so the vLLM import (and its quirks) stays in one place; the bench
calls it only when ``import vllm`` works.

vLLM runs in a child process (``python -m dora.bench.engine_vllm``) because it spawns its own
engine-core and worker processes, sets process-wide environment (OpenMP binding, torch
threads) and needs a ``__main__`` guard: the child isolates all of that from the typer CLI and
from the torch engine measured in the parent. Only ``llm.generate`` is timed (after a warmup),
so vLLM's ~25-50 s start is not counted, as model loading is not counted for the others.

Settings, chosen to match the torch engine's bench config (``EngineConfig`` defaults):
fp32, ``max_num_seqs=64``, ``max_num_batched_tokens=2048`` with chunked prefill, prefix
caching on (both engines have it; the random prompts share no prefix, so it rarely fires),
``enforce_eager`` (our engine and transformers run eager PyTorch too; torch.compile on two
shared cores is slow to start), ``skip_tokenizer_init`` (we pass token ids), a KV cache
sized for the workload (``VLLM_CPU_KVCACHE_SPACE``, GiB).

Fair cores: the child and every process it spawns (vLLM's engine core, its workers) are pinned
with ``sched_setaffinity`` to the same ``threads`` cores the parent's engines run on, and its
OpenMP is sized and bound to them (``OMP_NUM_THREADS``, ``VLLM_CPU_OMP_THREADS_BIND``), so
vLLM's scheduler process cannot borrow a core the torch engine does not get. The child reports
the affinity it ran with. Environment variables set by the caller win over these defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dora.bench.engine import Workload

MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 2048
_LOG_TAIL = 4000


class VllmRunError(RuntimeError):
    """The vLLM child failed, or generated other lengths than requested."""


@dataclass(frozen=True)
class VllmRun:
    """One timed vLLM generation: seconds of ``generate`` and each request's output length."""

    seconds: float
    output_lengths: list[int]
    startup_s: float
    cpus: list[int] = field(default_factory=list)  # affinity the child reported
    cpu_seconds: float = 0.0  # CPU time of the child and all its processes during generate
    omp_threads: int = 0  # torch threads in the child's front process


def vllm_note() -> str | None:
    """None when vLLM imports, else why it is skipped."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # not installed, or no usable build
        return f"skipped: import vllm failed ({type(exc).__name__})"
    return None


def run_vllm(directory: Path, work: Workload, protocol: bool = False) -> VllmRun:
    """vLLM generation of the workload (only where vLLM is installed): offline ``LLM``, or
    dora's ``VllmEngine`` with ``protocol``."""
    return generate_vllm(directory, work.prompts, work.lengths, protocol=protocol)


def generate_vllm(
    directory: Path,
    prompts: list[list[int]],
    lengths: list[int],
    threads: int | None = None,
    timeout_s: float = 3600.0,
    protocol: bool = False,
) -> VllmRun:
    """Generate ``lengths[i]`` tokens after ``prompts[i]`` with vLLM in a child process.

    ``protocol``: through dora's ``VllmEngine`` (the Engine protocol: ``add_request`` and
    ``step``, dora's sampling as a logits processor, the KV connector loaded) instead of
    vLLM's offline ``LLM.generate``; the difference is what dora's engine adds.

    ``threads`` defaults to the parent's torch threads (the bench sets them), so vLLM gets the
    same cores as the torch engine: the child is pinned to the first ``threads`` cores of the
    parent's affinity (``bench_cpus``). Raises ``VllmRunError`` (with the child's log tail) when
    the child fails or any request's output length differs from the one requested.
    """
    if len(prompts) != len(lengths):
        raise ValueError(f"prompts ({len(prompts)}) and lengths ({len(lengths)}) differ")
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="dora-vllm-") as tmp:
        job = Path(tmp) / "job.json"
        out = Path(tmp) / "result.json"
        log = Path(tmp) / "vllm.log"
        job.write_text(json.dumps({"prompts": prompts, "lengths": lengths}))
        cmd = [sys.executable, "-m", "dora.bench.engine_vllm", str(directory), str(job), str(out)]
        if protocol:
            cmd.append("--protocol")
        env = {**os.environ, **_vllm_env(directory, prompts, lengths, threads)}
        cpus = bench_cpus(threads)
        with log.open("w") as sink:
            try:
                proc = subprocess.run(
                    cmd,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    env=env,
                    timeout=timeout_s,
                    preexec_fn=lambda: os.sched_setaffinity(0, cpus),
                )
            except subprocess.TimeoutExpired as exc:
                raise VllmRunError(f"vLLM child timed out after {timeout_s:.0f} s") from exc
        if proc.returncode != 0 or not out.is_file():
            tail = log.read_text(errors="replace")[-_LOG_TAIL:]
            raise VllmRunError(f"vLLM child exited with {proc.returncode}:\n{tail}")
        result = json.loads(out.read_text())
    run = VllmRun(
        seconds=float(result["seconds"]),
        output_lengths=[int(n) for n in result["output_lengths"]],
        startup_s=float(result["startup_s"]),
        cpus=[int(c) for c in result.get("cpus", [])],
        omp_threads=int(result.get("torch_threads", 0)),
        cpu_seconds=float(result.get("cpu_seconds", 0.0)),
    )
    wrong = [i for i, (g, n) in enumerate(zip(run.output_lengths, lengths, strict=True)) if g != n]
    if wrong:
        i = wrong[0]
        raise VllmRunError(
            f"vLLM generated {run.output_lengths[i]} tokens for request {i}, "
            f"{lengths[i]} requested ({len(wrong)} requests wrong)"
        )
    return run


def _max_model_len(prompts: list[list[int]], lengths: list[int]) -> int:
    longest = max((len(p) + n for p, n in zip(prompts, lengths, strict=True)), default=1)
    return -(-longest // 16) * 16  # round up to a block of 16


def bench_cpus(threads: int) -> list[int]:
    """The cores a bench column with ``threads`` threads runs on: the first ``threads`` of this
    process's affinity (all of them for ``threads <= 0``)."""
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[:threads] if threads > 0 else allowed


def _vllm_env(
    directory: Path, prompts: list[list[int]], lengths: list[int], threads: int
) -> dict[str, str]:
    """vLLM CPU settings for the child; variables already set by the caller are kept."""
    config = json.loads((Path(directory) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * 4  # K and V, fp32
    need = per_token * MAX_NUM_SEQS * _max_model_len(prompts, lengths) * 1.25
    cpus = bench_cpus(max(1, threads))
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(need / 2**30))),
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cpus),
        "OMP_NUM_THREADS": str(len(cpus)),
        "VLLM_LOGGING_LEVEL": "WARNING",
        "TOKENIZERS_PARALLELISM": "false",
    }
    return {k: v for k, v in env.items() if k not in os.environ}


def tree_cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process and all its live descendants (from /proc):
    vLLM's engine core runs in a grandchild, so the child's own ``process_time`` misses it."""
    stats: dict[int, tuple[int, int]] = {}  # pid -> (parent, ticks)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
        except (OSError, ValueError, IndexError):  # exited meanwhile
            continue
    root = pid or os.getpid()
    tree, grew = {root}, True
    while grew:
        more = {p for p, (parent, _) in stats.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return sum(stats[p][1] for p in tree if p in stats) / os.sysconf("SC_CLK_TCK")


def _write_result(
    out: Path, seconds: float, cpu_seconds: float, startup: float, lengths: list[int]
) -> None:
    """The child's timing JSON (with the cores and threads it ran with)."""
    import torch

    result = {
        "cpus": sorted(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "startup_s": startup,
        "output_lengths": lengths,
    }
    out.write_text(json.dumps(result))


def _child(directory: Path, job: Path, out: Path) -> None:
    """Body of the child process: start vLLM, warm up, time ``generate``, write the result."""
    from vllm import LLM
    from vllm import SamplingParams as VSP

    spec: dict[str, Any] = json.loads(job.read_text())
    prompts: list[list[int]] = spec["prompts"]
    lengths: list[int] = spec["lengths"]
    start = time.perf_counter()
    llm = LLM(
        model=str(directory),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=_max_model_len(prompts, lengths),
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        enforce_eager=True,
        seed=0,
    )
    startup = time.perf_counter() - start

    def params(i: int, n: int) -> VSP:
        return VSP(temperature=1.0, top_p=1.0, top_k=0, max_tokens=n, ignore_eos=True, seed=i)

    # the parent's warmup: every decode batch size 1..64 once
    warm = [{"prompt_token_ids": [7] * 8} for _ in range(MAX_NUM_SEQS)]
    llm.generate(warm, [params(i, i + 1) for i in range(MAX_NUM_SEQS)], use_tqdm=False)
    requests = [{"prompt_token_ids": p} for p in prompts]
    sampling = [params(i, n) for i, n in enumerate(lengths)]
    start, cpu = time.perf_counter(), tree_cpu_seconds()
    outputs = llm.generate(requests, sampling, use_tqdm=False)
    seconds = time.perf_counter() - start
    cpu_seconds = tree_cpu_seconds() - cpu

    lengths_out = [len(o.outputs[0].token_ids) for o in outputs]
    _write_result(out, seconds, cpu_seconds, startup, lengths_out)


def _child_protocol(directory: Path, job: Path, out: Path) -> None:
    """Body of the child with ``--protocol``: the same timing through ``VllmEngine``."""

    from dora.engines.vllm.config import VllmEngineConfig
    from dora.engines.vllm.engine import VllmEngine
    from dora.events import Prompt, RolloutRequest, SamplingParams

    spec: dict[str, Any] = json.loads(job.read_text())
    prompts: list[list[int]] = spec["prompts"]
    lengths: list[int] = spec["lengths"]
    kv_gib = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    config = VllmEngineConfig(
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=_max_model_len(prompts, lengths),
        kv_cache_gib=kv_gib,
        ignore_eos=True,
    )
    start = time.perf_counter()
    engine = VllmEngine(directory, config, "bench")
    startup = time.perf_counter() - start

    def run(batch: list[list[int]], sizes: list[int], tag: str) -> list[int]:
        for i, (p, n) in enumerate(zip(batch, sizes, strict=True)):
            engine.add_request(
                RolloutRequest(
                    request_id=f"{tag}{i}",
                    prompt=Prompt(prompt_id=f"{tag}{i}", text=""),
                    prompt_token_ids=tuple(p),
                    group_id=f"{tag}{i}",
                    group_index=0,
                    version=0,
                    sampling=SamplingParams(temperature=1.0, seed=i, max_tokens=n),
                )
            )
        done: dict[str, int] = {}
        while engine.has_work():
            for t in engine.step():
                done[t.request.request_id] = len(t.completion_token_ids)
        return [done[f"{tag}{i}"] for i in range(len(batch))]

    run([[7] * 8] * MAX_NUM_SEQS, list(range(1, MAX_NUM_SEQS + 1)), "warm")
    start, cpu = time.perf_counter(), tree_cpu_seconds()
    lengths_out = run(prompts, lengths, "r")
    seconds = time.perf_counter() - start
    cpu_seconds = tree_cpu_seconds() - cpu
    engine.close()
    _write_result(out, seconds, cpu_seconds, startup, lengths_out)


def main(argv: list[str] | None = None) -> None:
    """``python -m dora.bench.engine_vllm DIRECTORY JOB.json RESULT.json`` (used by the bench)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("directory", type=Path, help="HF checkpoint directory")
    parser.add_argument("job", type=Path, help='JSON {"prompts": [[ids]], "lengths": [n]}')
    parser.add_argument("out", type=Path, help="where the timing JSON is written")
    parser.add_argument("--protocol", action="store_true", help="through dora's VllmEngine")
    args = parser.parse_args(argv)
    (_child_protocol if args.protocol else _child)(args.directory, args.job, args.out)


if __name__ == "__main__":
    main()
