"""``dora stage serve``: one stage of a pipeline file in this process, against a NATS server.

``dora run --processes`` starts one of these per stage replica; it can also be started by
hand (or by a process manager) on another machine, given the run's NATS URL, run id and the
stage's login (``RUN_DIR/credentials/stage-<name>.json`` for a run's embedded server). The
first SIGTERM or SIGINT drains the stage and exits 0; a finite stage (prompt source, learner)
exits 0 when it has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import structlog
import typer

from dora import interrupt
from dora.logs import LEVELS
from dora.logs import configure as configure_logs

if TYPE_CHECKING:
    from dora.pipeline import Pipeline

app = typer.Typer(help="Run one stage of a pipeline in this process (see `dora run --processes`).")


async def serve(pipeline: Pipeline, ready: Path, progress: Path) -> None:
    """Run until the stage finishes or a signal drains it; raise if it fails. ``ready`` is
    written once the stage has started (its consumers exist): the supervisor starts the next
    stage only then. ``progress``: its counters, kept current for the supervisor."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal() -> None:
        interrupt.request()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal)

    reporter: asyncio.Task[None] | None = None

    def started() -> None:
        nonlocal reporter
        ready.parent.mkdir(parents=True, exist_ok=True)
        ready.write_text("")
        reporter = asyncio.create_task(report_progress(pipeline, progress))

    try:
        await serve_until(pipeline, stop, on_started=started)
    finally:
        if reporter is not None:
            reporter.cancel()
            write_progress(pipeline, progress)


async def serve_until(
    pipeline: Pipeline, stop: asyncio.Event, on_started: Callable[[], None] = lambda: None
) -> None:
    """The one way a stage replica is served, in its own process or in a Ray actor: start it,
    call ``on_started`` (its consumers exist), run until it finishes or ``stop`` is set (then
    drain it); raise if it fails."""
    async with pipeline:
        on_started()
        waiter = asyncio.create_task(pipeline.wait())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():
            await pipeline.stop()
        stopper.cancel()
        await waiter


PROGRESS_EVERY_S = 1.0


async def report_progress(pipeline: Pipeline, path: Path) -> None:
    """The stage's counters for the supervisor's live view, rewritten every second."""
    while True:
        write_progress(pipeline, path)
        await asyncio.sleep(PROGRESS_EVERY_S)


def write_progress(pipeline: Pipeline, path: Path) -> None:
    from dora.files import write_atomically

    write_atomically(path, json.dumps(pipeline.progress()))


@app.command("serve")
def serve_cli(
    pipeline_file: Annotated[Path, typer.Argument(help="The pipeline YAML file.")],
    stage: Annotated[str, typer.Option("--stage", help="The stage's name in the file.")],
    nats: Annotated[str, typer.Option("--nats", help="NATS URL of the run's server.")],
    run_id: Annotated[str, typer.Option("--run-id", help="The run's id.")],
    run_dir: Annotated[Path, typer.Option("--run-dir", help="The run's folder.")],
    replica: Annotated[int, typer.Option("--replica", min=0, help="Which replica this is.")] = 0,
    replicas: Annotated[
        int,
        typer.Option(
            "--replicas",
            min=1,
            help="Pull loops in this process (replicas hosted, from --replica, for a stage "
            "that hosts its replicas, such as generator).",
        ),
    ] = 1,
    nats_creds: Annotated[
        Path | None, typer.Option("--nats-creds", help="The stage's login (JSON or .creds).")
    ] = None,
    nats_ca: Annotated[
        Path | None, typer.Option("--nats-ca", help="CA certificate for a tls:// --nats URL.")
    ] = None,
    overrides: Annotated[
        list[str] | None, typer.Option("--set", help="As `dora run --set`.")
    ] = None,
    max_steps: Annotated[int | None, typer.Option("--max-steps", min=1)] = None,
    log_level: Annotated[str, typer.Option("--log-level")] = "warning",
) -> None:
    """Serve one stage replica until it finishes (finite stages) or is signalled."""
    from dora.bus.auth import NatsAuth
    from dora.pipeline import PipelineConfigError, PipelineError, load_pipeline
    from dora.pipeline.processes import progress_path, ready_path, summary_path
    from dora.stage import StageError

    if log_level not in LEVELS:
        raise typer.BadParameter(f"--log-level must be one of {', '.join(LEVELS)}")
    try:
        auth = NatsAuth.from_options(nats_creds, nats_ca)
        pipeline = load_pipeline(
            pipeline_file,
            run_id=run_id,
            nats_url=nats,
            nats_auth=auth,
            run_dir=run_dir,
            overrides=overrides or (),
            max_steps=max_steps,
        ).keep_only(stage, replicas, replica)
    except (PipelineConfigError, StageError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    pipeline.stall_timeout = None  # the supervisor watches the run as a whole
    pipeline.summary_file = summary_path(run_dir, stage, replica)
    # the run's log file, shared with the other processes (appended line by line), each line
    # tagged with this process's stage and replica
    configure_logs(run_dir, log_level, file_level="debug" if log_level == "debug" else "info")  # type: ignore[arg-type]
    structlog.contextvars.bind_contextvars(process=f"{stage}-{replica}")
    try:
        asyncio.run(
            serve(
                pipeline,
                ready_path(run_dir, stage, replica),
                progress_path(run_dir, stage, replica),
            )
        )
    except PipelineError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    pipeline.write_summary()
