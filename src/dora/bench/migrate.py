"""``dora bench migrate``: resuming a request elsewhere by KV migration vs by re-prefill.

For each model and context length a request is prefilled on engine A and has generated one
token. Then it is resumed on engine B two ways, each timed until B has produced the next
token:

- migrate: ``export_request`` + transfer through the real NATS JetStream object store (an
  embedded nats-server in a temp dir, ``NatsBus.put_blob``, then a linear-time get: see
  ``get_blob_linear``) + ``import_request``
  + one decode step;
- re-prefill: the partial-rollout way, a new request with ``resume`` = the tokens so far,
  prefilled from scratch (chunked under the engine's token budget) + the next token.

``--engines vllm`` measures the same on two ``VllmEngine``s (the ``vllm`` extra): export is
an abort whose blocks the dora KV connector hands over, import adds the request with its
context supplied as cached KV; prefix caching is off there so the re-prefill is computed.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import typer


def _request(rid: str, prompt: list[int], max_tokens: int, resume: Any = None) -> Any:
    from dora.events import Prompt, RolloutRequest, SamplingParams

    return RolloutRequest(
        request_id=rid,
        prompt=Prompt(prompt_id=rid, text=""),
        prompt_token_ids=tuple(prompt),
        group_id=rid,
        group_index=0,
        version=0,
        sampling=SamplingParams(temperature=1.0, seed=7, max_tokens=max_tokens),
        resume=resume,
    )


async def get_blob_linear(bus: Any, name: str) -> bytes:
    """The blob's bytes (``NatsBus.get_blob`` streams chunks into a buffer: linear time)."""
    return bytes(await bus.get_blob(name))


async def measure(preset: str, contexts: list[int], bus: Any) -> list[dict[str, Any]]:
    """Rows of one model: one per context length."""
    from dora.engines.torch import EngineConfig, TorchEngine
    from dora.events import ResumeState
    from dora.models import build_model

    longest = max(contexts)
    model, tok = build_model(preset, seed=0, max_position_embeddings=longest + 256)
    blocks = 2 * (-(-(longest + 64) // 16)) + 8
    config = EngineConfig(num_blocks=blocks, max_num_batched_tokens=2048, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    for ctx in contexts:
        a = TorchEngine(model, tok, config, engine_id="a")
        b = TorchEngine(model, tok, config, engine_id="b")
        prompt = [(i * 7919) % 90 + 8 for i in range(ctx - 1)]
        rid = f"{preset}-{ctx}"
        a.add_request(_request(rid, prompt, max_tokens=8))
        while a.counters.generated_tokens < 1:
            a.step()
        seq = a._seqs[rid]
        done_tokens = list(seq.completion)
        # --- migrate: export -> object store -> import -> next token
        t0 = time.perf_counter()
        data = a.export_request(rid)
        t1 = time.perf_counter()
        ref = await bus.put_blob(f"kv-{rid}", data)
        got = await get_blob_linear(bus, ref.name)
        t2 = time.perf_counter()
        b.import_request(got)
        t3 = time.perf_counter()
        b.step()
        t4 = time.perf_counter()
        a.release_exported(rid)
        assert b.counters.prefill_tokens == 0, "import must not prefill"
        await bus.delete_blob(ref.name)
        # --- re-prefill: prompt + generated tokens computed again, then the next token
        c = TorchEngine(model, tok, config, engine_id="c")
        resume = ResumeState(
            token_ids=tuple(done_tokens), logprobs=tuple(seq.logprobs), engines=("a",)
        )
        r0 = time.perf_counter()
        c.add_request(_request(rid, prompt, max_tokens=8, resume=resume))
        while c.counters.generated_tokens < 1:
            c.step()
        r1 = time.perf_counter()
        migrate_s = t4 - t0
        reprefill_s = r1 - r0
        rows.append(
            {
                "model": preset,
                "engine": "dora",
                "context": ctx,
                "kv_bytes": len(data),
                "kv_bytes_per_token": b.runner.kv_bytes_per_token(),
                "export_s": t1 - t0,
                "transfer_s": t2 - t1,
                "import_s": t3 - t2,
                "first_decode_s": t4 - t3,
                "migrate_s": migrate_s,
                "reprefill_s": reprefill_s,
                "reprefilled_tokens": c.counters.reprefilled_tokens,
                "ratio": migrate_s / reprefill_s,
            }
        )
    return rows


async def measure_vllm(preset: str, contexts: list[int], bus: Any) -> list[dict[str, Any]]:
    """Rows of one model on two vLLM engines: one per context length."""
    from dora.engines.vllm.config import VllmEngineConfig
    from dora.engines.vllm.engine import VllmEngine
    from dora.events import ResumeState
    from dora.models import build_model, save_pretrained

    longest = max(contexts)
    model, tok = build_model(preset, seed=0, max_position_embeddings=longest + 256)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, Path(tmp), tok)
        config = VllmEngineConfig(
            max_model_len=longest + 64,
            block_size=32,
            kv_cache_gib=1.0,
            enable_prefix_caching=False,
            ignore_eos=True,
        )
        a = VllmEngine(Path(tmp), config, "a")
        b = VllmEngine(Path(tmp), config, "b")
        try:
            for engine in (a, b):  # vLLM's first steps set up kernels: not part of a move
                for n in (16, 2048):
                    engine.add_request(_request(f"warm-{n}", [9] * n, max_tokens=4))
                    while engine.has_work():
                        engine.step()
            for ctx in contexts:
                prompt = [(i * 7919) % 90 + 8 for i in range(ctx - 1)]
                rid = f"{preset}-{ctx}-vllm"
                a.add_request(_request(rid, prompt, max_tokens=8))
                while not a._held[rid].tokens:
                    a.step()
                # --- migrate: export -> object store -> import -> next token
                t0 = time.perf_counter()
                data = a.export_request(rid)
                t1 = time.perf_counter()
                ref = await bus.put_blob(f"kv-{rid}", data)
                got = await get_blob_linear(bus, ref.name)
                t2 = time.perf_counter()
                b.import_request(got)
                t3 = time.perf_counter()
                held = b._held[rid]
                done = len(held.tokens)
                while len(held.tokens) == done:
                    b.step()
                t4 = time.perf_counter()
                migrated_reprefill = held.reprefilled
                tokens, logprobs = held.tokens[:done], held.logprobs[:done]
                b.abort(rid)
                a.release_exported(rid)
                await bus.delete_blob(ref.name)
                # --- re-prefill on the same engine (no prefix cache): the context again
                again = f"{rid}-again"
                resume = ResumeState(
                    token_ids=tuple(tokens), logprobs=tuple(logprobs), engines=("a",)
                )
                r0 = time.perf_counter()
                b.add_request(_request(again, prompt, max_tokens=8 + done, resume=resume))
                while len(b._held[again].tokens) == done:
                    b.step()
                r1 = time.perf_counter()
                reprefilled = b._held[again].reprefilled
                b.abort(again)
                migrate_s, reprefill_s = t4 - t0, r1 - r0
                rows.append(
                    {
                        "model": preset,
                        "engine": "vllm",
                        "context": ctx,
                        "kv_bytes": len(data),
                        "export_s": t1 - t0,
                        "transfer_s": t2 - t1,
                        "import_s": t3 - t2,
                        "first_decode_s": t4 - t3,
                        "migrate_s": migrate_s,
                        "migrate_reprefilled_tokens": migrated_reprefill,
                        "reprefill_s": reprefill_s,
                        "reprefilled_tokens": reprefilled,
                        "ratio": migrate_s / reprefill_s,
                    }
                )
        finally:
            a.close()
            b.close()
    return rows


async def _run(
    models: list[str], contexts: list[int], store: Path, engines: list[str]
) -> list[dict[str, Any]]:
    from dora.bench.report import print_table
    from dora.bus import NatsBus
    from dora.bus.server import NatsServer
    from dora.subjects import Subjects

    server = NatsServer(store).start()
    bus = NatsBus(Subjects("benchmigrate"), server.url)
    await bus.connect()
    rows: list[dict[str, Any]] = []
    try:
        for preset in models:
            for kind in engines:
                how = measure if kind == "dora" else measure_vllm
                new = await how(preset, contexts, bus)
                print_table(f"migrate: {preset} ({kind})", new)
                rows.extend(new)
    finally:
        await bus.close()
        server.stop()
    return rows


def cli(
    models: str = typer.Option("tiny,small", "--models", help="Comma-separated presets."),
    contexts: str = typer.Option("256,1024,4096", "--contexts", help="Context lengths."),
    quick: bool = typer.Option(False, "--quick", help="Tiny model, contexts 256 and 1024."),
    threads: int = typer.Option(1, "--threads", help="torch threads (0: torch default)."),
    engines: str = typer.Option(
        "dora", "--engines", help="Comma-separated: dora (built-in), vllm (the vllm extra)."
    ),
) -> None:
    """Time to resume a request on another engine: KV migration vs re-prefill."""
    import torch

    from dora.bench.report import print_table, save_rows

    if threads:
        torch.set_num_threads(threads)
    names = ["tiny"] if quick else [m.strip() for m in models.split(",") if m.strip()]
    lengths = [256, 1024] if quick else [int(c) for c in contexts.split(",") if c.strip()]
    kinds = [e.strip() for e in engines.split(",") if e.strip()]
    if not kinds or set(kinds) - {"dora", "vllm"}:
        raise typer.BadParameter("name dora and/or vllm", param_hint="--engines")
    if "vllm" in kinds:
        from dora.engines.vllm import vllm_missing

        missing = vllm_missing()
        if missing is not None:
            raise typer.BadParameter(missing, param_hint="--engines")
    with tempfile.TemporaryDirectory() as tmp:
        rows = asyncio.run(_run(names, lengths, Path(tmp), kinds))
    print_table("dora bench migrate (goal: ratio < 1 at >= 1024 on small, <= 0.25 at 4096)", rows)
    meta = {"quick": quick, "threads": torch.get_num_threads(), "engines": kinds}
    path = save_rows("migrate", rows, meta=meta)
    typer.echo(f"saved {path}")
