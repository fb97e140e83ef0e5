"""``dora bench weights``: seconds per policy version, from the learner's serialized state
dict to verified bytes on every engine, by the NATS object store and by the broadcast
(``weight_store: broadcast``), for the tiny and small models, side by side in one run.

A round serializes the state dict once (both paths share it; not timed), then
- objectstore: the learner puts the blob; ``--engines`` engines, each on its own NATS
  connection, get it at once and check its sha256;
- broadcast: the learner offers the blob; the engines (threads of this process, on loopback
  gloo) take tickets at once, are served in one wave, and check the sha256.
Each round alternates which path goes first; the table gives medians over rounds and the
ratio objectstore / broadcast. What it does not show: GPU memory to GPU memory over NCCL,
which skips serialization and host copies; the ``gpu_estimate_s`` column is bytes over an
assumed bus bandwidth (``--gpu-gbps``), not a measurement.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import typer

MODELS = ("tiny", "small")


async def _object_store(url: str, run: str, name: str, data: bytes, engines: int) -> float:
    from dora.bus import NatsBus
    from dora.learner.weights import sha256
    from dora.subjects import Subjects

    subjects = Subjects(run)
    buses = [NatsBus(subjects, url) for _ in range(engines + 1)]
    for bus in buses:
        await bus.connect()
    try:
        digest = sha256(data)
        t0 = time.perf_counter()
        ref = await buses[0].put_blob(name, data)

        async def fetch(bus: NatsBus) -> None:
            got = await bus.get_blob(ref.name)
            if await asyncio.to_thread(sha256, got) != digest:
                raise RuntimeError("object store: bytes differ")

        await asyncio.gather(*(fetch(b) for b in buses[1:]))
        seconds = time.perf_counter() - t0
        await buses[0].delete_blob(ref.name)
        return seconds
    finally:
        for bus in buses:
            await bus.close()


async def _broadcast(name: str, data: bytes, engines: int, bucket_mb: float) -> float:
    from dora.learner.broadcast import BroadcastConfig, BroadcastServer, receive
    from dora.learner.weights import sha256

    server = BroadcastServer(BroadcastConfig(bucket_mb=bucket_mb, gather_s=0.02))
    try:
        digest = sha256(data)
        t0 = time.perf_counter()
        ref = await asyncio.to_thread(server.offer, name, data)

        async def fetch() -> None:
            got = await asyncio.to_thread(receive, ref)
            if await asyncio.to_thread(sha256, got) != digest:
                raise RuntimeError("broadcast: bytes differ")

        await asyncio.gather(*(fetch() for _ in range(engines)))
        seconds = time.perf_counter() - t0
        if [w.receivers for w in server.waves] != [engines]:
            raise RuntimeError(f"expected one wave of {engines}, got {server.waves}")
        return seconds
    finally:
        server.close()


def measure(url: str, engines: int, rounds: int, bucket_mb: float, gpu_gbps: float) -> list[dict]:
    from dora.learner.weights import serialize_state_dict
    from dora.models import build_model, hf_state_dict

    rows = []
    for preset in MODELS:
        model, _ = build_model(preset)
        params = sum(p.numel() for p in model.parameters())
        data = serialize_state_dict(hf_state_dict(model))
        times: dict[str, list[float]] = {"objectstore": [], "broadcast": []}
        for r in range(rounds):
            order = ("objectstore", "broadcast") if r % 2 == 0 else ("broadcast", "objectstore")
            for path in order:
                name = f"bench-{preset}-{r}"
                if path == "objectstore":
                    run = f"benchw{r}"
                    seconds = asyncio.run(_object_store(url, run, name, data, engines))
                else:
                    seconds = asyncio.run(_broadcast(name, data, engines, bucket_mb))
                times[path].append(seconds)
        store, cast = (statistics.median(times[k]) for k in ("objectstore", "broadcast"))
        for path, seconds in (("objectstore", store), ("broadcast", cast)):
            rows.append(
                {
                    "model": preset,
                    "params_M": round(params / 1e6, 2),
                    "MB": round(len(data) / 1e6, 2),
                    "engines": engines,
                    "path": path,
                    "s_per_version": round(seconds, 4),
                    "MB_per_s_per_engine": round(len(data) / 1e6 / seconds, 1),
                    "objectstore_over_broadcast": round(store / cast, 2),
                    "gpu_estimate_s": round(len(data) / (gpu_gbps * 1e9), 5),
                }
            )
    return rows


def cli(
    engines: int = typer.Option(2, "--engines", min=1, help="Engines loading each version."),
    rounds: int = typer.Option(5, "--rounds", min=1, help="Rounds per path (median reported)."),
    bucket_mb: float = typer.Option(64.0, "--bucket-mb", help="Broadcast bucket size."),
    gpu_gbps: float = typer.Option(
        100.0, "--gpu-gbps", help="Assumed NCCL bus bandwidth for the estimate column."
    ),
    results_dir: Path = typer.Option(Path("runs/bench"), "--results-dir"),
) -> None:
    """Seconds per version: NATS object store against gloo broadcast (table + JSON)."""
    from dora.bench.report import print_table, save_rows
    from dora.bus.server import NatsServer
    from dora.logs import configure

    configure(None, "warning")  # the table, not every connection's log line
    with (
        tempfile.TemporaryDirectory(prefix="dora-bench-weights-") as tmp,
        NatsServer(Path(tmp)) as server,
    ):
        rows = measure(server.url, engines, rounds, bucket_mb, gpu_gbps)
    print_table("dora bench weights: learner state dict -> verified bytes on every engine", rows)
    meta = {"engines": engines, "rounds": rounds, "bucket_mb": bucket_mb, "gpu_gbps": gpu_gbps}
    path = save_rows("weights", rows, meta=meta, results_dir=results_dir)
    typer.echo(f"saved {path}")
