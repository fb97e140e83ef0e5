"""``dora bench engine``: generation throughput of the torch engine vs transformers ``generate``.

Two workloads, the same for every implementation (random-init weights, eos ignored, lengths
forced by ``max_tokens``):

- ``uniform``: N requests x L new tokens (full: 64 x 256);
- ``longtail``: M requests whose lengths are lognormal, clipped at 2,048 (full: 256).

transformers runs static batches of 64 (a batch generates until its longest request is done:
the cost continuous batching removes); the torch engine runs continuous batching with at most
64 running sequences (decode attention in its compiled paged kernel when it builds; the JSON
meta says which). Tokens/s counts requested tokens only. vLLM is measured when
``import vllm`` works, else the row says why it is missing.

Same cores for every column: ``--threads N`` pins this process to N cores (its torch engine and
transformers run there with N torch threads) and the vLLM child, with all its processes, to the
same N cores; the JSON meta records each column's cores and threads.
"""

from __future__ import annotations

import math
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer


@dataclass(frozen=True)
class Workload:
    """Prompts (token ids) and the number of new tokens each must generate."""

    name: str
    prompts: list[list[int]]
    lengths: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


WARM_SEQS = 64


def make_workloads(
    quick: bool,
    longtail_requests: int = 256,
    clip: int = 2048,
    vocab_lo: int = 6,
    vocab_hi: int = 100,
) -> list[Workload]:
    """The two workloads (seeded, so every implementation sees the same)."""
    rng = random.Random(0)
    prompt_len = 32

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(vocab_lo, vocab_hi) for _ in range(prompt_len)] for _ in range(n)]

    n_a, len_a = (16, 32) if quick else (64, 256)
    n_b, clip = (32, 256) if quick else (longtail_requests, clip)
    median = 48 if quick else 192
    tail = [max(1, min(clip, int(math.exp(rng.gauss(math.log(median), 1.0))))) for _ in range(n_b)]
    return [
        Workload(f"uniform {n_a}x{len_a}", prompts(n_a), [len_a] * n_a),
        Workload(f"longtail {n_b} (lognormal, clip {clip})", prompts(n_b), tail),
    ]


@dataclass(frozen=True)
class Timing:
    """Wall seconds of a run and the CPU seconds it used (all threads of the process).

    On a shared machine the wall time depends on what else runs; tokens per CPU second
    compares implementations on the work they do."""

    wall: float
    cpu: float

    @staticmethod
    def best(a: Timing, b: Timing) -> Timing:
        return Timing(min(a.wall, b.wall), min(a.cpu, b.cpu))


def run_torch_engine(
    model: Any, tokenizer: Any, work: Workload, max_seqs: int = 64, fast: bool = True
) -> Timing:
    """Time for the torch engine to generate the workload (continuous batching)."""
    from dora.engines.torch import EngineConfig, TorchEngine
    from dora.events import Prompt, RolloutRequest, SamplingParams

    per_req = max(len(p) + n for p, n in zip(work.prompts, work.lengths, strict=True))
    blocks = max_seqs * (-(-per_req // 16) + 1)
    config = EngineConfig(
        block_size=16,
        num_blocks=blocks,
        max_num_seqs=max_seqs,
        ignore_eos=True,
        fast_forward=fast,
    )
    engine = TorchEngine(model, tokenizer, config, engine_id="bench", version=0)
    requests = [
        RolloutRequest(
            request_id=f"r{i}",
            prompt=Prompt(prompt_id=f"p{i}", text=""),
            prompt_token_ids=tuple(p),
            group_id=f"g{i}",
            group_index=0,
            version=0,
            sampling=SamplingParams(temperature=1.0, seed=i, max_tokens=n),
        )
        for i, (p, n) in enumerate(zip(work.prompts, work.lengths, strict=True))
    ]
    start, cpu = time.perf_counter(), time.process_time()
    for r in requests:
        engine.add_request(r)
    done = 0
    while engine.has_work():
        done += len(engine.step())
    elapsed = Timing(time.perf_counter() - start, time.process_time() - cpu)
    assert done == len(requests), "engine lost requests"
    return elapsed


def transformers_bound(
    uniform: Workload, uniform_time: Timing, work: Workload, batch: int = 64
) -> Timing:
    """A lower bound on transformers' time for ``work``, from its measured ``uniform`` run.

    Why: on the small model the long-tailed run takes transformers over an hour. Its static
    batches each decode for their longest request, with the same prompt length as the
    uniform run, and a step is never cheaper than the uniform run's step at the same
    position (the contexts are at least as long). So a batch of ``n >= steps_u`` steps takes
    at least ``n / steps_u`` times the uniform run (prefill included); shorter batches are
    counted as 0. The uniform run must be full static batches of one length."""
    steps_u = uniform.lengths[0]
    if set(uniform.lengths) != {steps_u} or len(uniform.prompts) != batch:
        raise ValueError("the uniform run must be one static batch of equal lengths")
    if {len(p) for p in work.prompts} != {len(uniform.prompts[0])}:
        raise ValueError("the bound needs the uniform run's prompt length")
    steps = [max(work.lengths[i : i + batch]) for i in range(0, len(work.lengths), batch)]
    scale = sum(n / steps_u for n in steps if n >= steps_u)
    return Timing(uniform_time.wall * scale, uniform_time.cpu * scale)


def run_transformers(directory: Path, work: Workload, batch: int = 64) -> Timing:
    """Time for transformers ``generate`` in static batches (sampling, eos ignored)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(work.prompts), batch):
        ids = torch.tensor(work.prompts[i : i + batch])  # equal prompt lengths: no padding
        longest = max(work.lengths[i : i + batch])
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
            )
    return Timing(time.perf_counter() - start, time.process_time() - cpu)


def cli(
    models: str = typer.Option("tiny,small", "--models", help="Comma-separated presets."),
    quick: bool = typer.Option(False, "--quick", help="Small workloads (smoke run)."),
    threads: int = typer.Option(1, "--threads", help="torch threads (0: torch default)."),
    repeats: int = typer.Option(1, "--repeats", help="Alternating runs per impl; best kept."),
    longtail_requests: int = typer.Option(256, "--longtail-requests"),
    clip: int = typer.Option(2048, "--clip", help="Longest completion of the longtail run."),
    workloads: str = typer.Option(
        "uniform,longtail", "--workloads", help="Comma-separated: uniform, longtail."
    ),
    transformers_longtail: str = typer.Option(
        "run",
        "--transformers-longtail",
        help="run, or bound: a lower bound on its time from its uniform run (needs uniform).",
    ),
) -> None:
    """Tokens/s of the torch engine vs transformers generate (and vLLM when installed)."""
    wanted = {w.strip() for w in workloads.split(",") if w.strip()}
    unknown = wanted - {"uniform", "longtail"}
    if unknown:
        raise typer.BadParameter(f"unknown workload(s) {sorted(unknown)}", param_hint="--workloads")
    if transformers_longtail not in ("run", "bound"):
        raise typer.BadParameter("must be run or bound", param_hint="--transformers-longtail")
    if transformers_longtail == "bound" and "uniform" not in wanted:
        raise typer.BadParameter(
            "bound is computed from the uniform run", param_hint="--transformers-longtail"
        )
    import torch

    from dora.bench.engine_vllm import bench_cpus, run_vllm, vllm_note
    from dora.bench.report import print_table, save_rows
    from dora.engines.torch import fast_forward, paged_kernel
    from dora.models import build_model, save_pretrained

    cpus = bench_cpus(threads)
    if threads:
        os.sched_setaffinity(0, cpus)  # our engine and transformers: these cores only
        torch.set_num_threads(threads)
    here = {"cpus": sorted(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads()}
    columns: dict[str, Any] = {"dora": here, "transformers": here}
    rows: list[dict[str, Any]] = []
    note = vllm_note()
    for preset in [m.strip() for m in models.split(",") if m.strip()]:
        model, tok = build_model(preset, seed=0)
        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(model, Path(tmp), tok)
            # every decode batch size 1..64 once (kernels picked or JIT-built per shape),
            # the same warmup as the vLLM child's
            warm = Workload("warmup", [[7] * 8] * WARM_SEQS, list(range(1, WARM_SEQS + 1)))
            run_torch_engine(model, tok, warm)
            run_transformers(Path(tmp), warm)
            measured: dict[str, tuple[Workload, Timing]] = {}
            for work in make_workloads(quick, longtail_requests, clip):
                kind = work.name.split()[0]
                if kind not in wanted:
                    continue
                bound = kind == "longtail" and transformers_longtail == "bound"
                ours = hf = Timing(math.inf, math.inf)
                for _ in range(max(1, repeats)):  # alternate, keep the best of each
                    ours = Timing.best(ours, run_torch_engine(model, tok, work))
                    if not bound:
                        hf = Timing.best(hf, run_transformers(Path(tmp), work))
                if bound:
                    hf = transformers_bound(*measured["uniform"], work)
                measured[kind] = (work, hf)
                n = work.tokens
                row: dict[str, Any] = {
                    "model": preset,
                    "workload": work.name,
                    "tokens": n,
                    "dora_tok_s": n / ours.wall,
                    "transformers_tok_s": n / hf.wall,
                    "speedup": hf.wall / ours.wall,
                    # tokens per CPU second: robust to other load on a shared machine
                    "dora_cpu_tok_s": n / ours.cpu,
                    "transformers_cpu_tok_s": n / hf.cpu,
                    "cpu_speedup": hf.cpu / ours.cpu,
                    # bound: transformers not run, its time bounded from below (so its
                    # tok/s are an upper bound and the speedups lower bounds)
                    "transformers": "lower bound" if bound else "run",
                }
                if note is None:
                    run = run_vllm(Path(tmp), work)
                    row["vllm_tok_s"] = n / run.seconds
                    row["dora_vs_vllm"] = run.seconds / ours.wall
                    row["vllm_cpu_tok_s"] = n / run.cpu_seconds if run.cpu_seconds else None
                    row["dora_vs_vllm_cpu"] = run.cpu_seconds / ours.cpu
                    # vLLM as an engine of dora (the Engine protocol, dora's sampling, the
                    # KV connector): what dora's layer costs on top of vLLM's own loop
                    through = run_vllm(Path(tmp), work, protocol=True)
                    row["dora_vllm_tok_s"] = n / through.seconds
                    row["dora_vllm_vs_vllm"] = run.seconds / through.seconds
                    columns["vllm"] = {
                        "cpus": run.cpus,
                        "torch_threads": run.omp_threads,
                        "pinned_to": bench_cpus(torch.get_num_threads()),
                    }
                else:
                    row["vllm"] = "not installed" if "ModuleNotFound" in note else note
                rows.append(row)
                print_table("engine throughput (so far)", rows[-1:])
    print_table("dora bench engine: tokens/s (goal: >=1.5x on uniform, >=3x on longtail)", rows)
    path = save_rows(
        "engine",
        rows,
        meta={
            "quick": quick,
            "threads": torch.get_num_threads(),
            "columns": columns,  # cores and threads each implementation ran with
            "fast_forward": fast_forward.supported(),
            "linear": fast_forward.best_linear(),
            "repeats": repeats,
            "vllm": note,
            "longtail_requests": longtail_requests,
            "clip": clip,
            "transformers_longtail": transformers_longtail,
            # decode attention in the compiled paged kernel (else the torch gather path)
            "paged_kernel": paged_kernel.load() is not None,
        },
    )
    typer.echo(f"saved {path}")
