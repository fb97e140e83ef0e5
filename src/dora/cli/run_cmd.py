"""``dora run PIPELINE.yaml``: run a pipeline with a live progress display, then summarize.

Without ``--nats`` it starts an embedded nats-server with JetStream in the run directory
(default ``runs/<run_id>/``) and stops it at the end; the summary goes to
``<run_dir>/summary.json``. A first Ctrl-C (or SIGTERM) drains the stages, writes the summary
and exits 128 + the signal (130 for Ctrl-C): the run did not finish; a second one, or one
during start-up (the warm start included), stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from dora import interrupt
from dora.bus.auth import CREDENTIALS_DIR, OUTSIDE_ROLES, NatsAuth
from dora.cli.progress_view import ProgressView, progress_rows
from dora.logs import LEVELS
from dora.logs import configure as configure_logs

if TYPE_CHECKING:
    from rich.console import Console

    from dora.deploy.ray import RayRun
    from dora.pipeline import Pipeline
    from dora.pipeline.processes import ProcessRun


SMOKE_STEPS = 3
SMOKE_OVERRIDES = ("learner.eval.set.per_stratum=0",)
"""``--smoke``: a few steps and no held-out eval (the learner stage found by its type)."""


async def _run(
    pipeline: Pipeline,
    console: Console,
    received: list[int],
    refresh_s: float = 0.2,
    quiet: bool = False,
) -> dict[str, Any]:
    """Run to completion; a first signal drains the stages (its number lands in
    ``received``), a second one, or one during start-up, cancels."""
    loop = asyncio.get_running_loop()
    interrupt.clear()
    stop = asyncio.Event()
    current = asyncio.current_task()

    def on_signal(signum: int) -> None:
        received.append(signum)
        interrupt.request()  # reaches a warm start or an evaluation running in a thread
        if pipeline.runners and not stop.is_set():
            stop.set()  # running: drain the stages
        elif current is not None:
            current.cancel()  # still starting (e.g. connecting), or a second signal: give up

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal, sig)
    try:
        async with pipeline:
            _announce(pipeline, console)
            waiter = asyncio.create_task(pipeline.wait())
            stopper = asyncio.create_task(stop.wait())
            with ProgressView(console, quiet) as view:
                view.show(progress_rows(pipeline.progress()))
                while not waiter.done():
                    await asyncio.wait({waiter, stopper}, timeout=refresh_s)
                    if stopper.done() and not waiter.done():
                        console.print("[yellow]stopping: draining stages...")
                        await pipeline.stop()
                    view.show(progress_rows(pipeline.progress()))
            stopper.cancel()
            await waiter
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
    summary = pipeline.summary()
    pipeline.write_summary(summary)
    return summary


async def _run_processes(
    supervisor: ProcessRun | RayRun,
    console: Console,
    received: list[int],
    refresh_s: float = 0.5,
    quiet: bool = False,
) -> dict[str, Any]:
    """``--processes`` and ``--ray``: the supervisor runs the stage processes (or actors); a
    first signal drains them all, a second one gives up. The live view is the in-process
    one, fed by the stages' progress."""
    loop = asyncio.get_running_loop()
    interrupt.clear()
    current = asyncio.current_task()

    def on_signal(signum: int) -> None:
        received.append(signum)
        if supervisor.children and len(received) == 1:
            supervisor.stop()
        elif current is not None:
            current.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal, sig)
    try:
        task = asyncio.create_task(supervisor.run())
        announced = False
        with ProgressView(console, quiet) as view:
            while not task.done():
                await asyncio.wait({task}, timeout=refresh_s)
                if not announced and supervisor.children:
                    _announce(supervisor.pipeline, console)
                    announced = True
                view.show(progress_rows(supervisor.progress()), supervisor.progress_line())
        summary = await task
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
    supervisor.pipeline.write_summary(summary)
    return summary


def _run_on_ray(
    pipe: Pipeline,
    pipeline_file: Path,
    address: str | None,
    overrides: list[str] | None,
    max_steps: int | None,
    level: str,
    console: Console,
    received: list[int],
    quiet: bool,
) -> dict[str, Any]:
    """``--ray``: join (or start) the Ray cluster, run the stages as actors, leave it."""
    from dora.deploy.ray import RayRun, connect, require_ray

    connect(address)
    try:
        supervisor = RayRun(
            pipe, pipeline_file, overrides=overrides, max_steps=max_steps, log_level=level
        )
        return asyncio.run(_run_processes(supervisor, console, received, quiet=quiet))
    finally:
        require_ray().shutdown()


def _announce(pipeline: Pipeline, console: Console) -> None:
    """Print where the run's streams are and record it in ``run.json``, so an outside
    service can find the embedded server's random port without reading a log."""
    url = pipeline.connected_url
    console.print(f"nats [bold]{url}[/bold] run id [bold]{pipeline.run_id}[/bold]", highlight=False)
    path = pipeline.run_dir / RUN_FILE
    creds = pipeline.credentials
    outside = {}
    if creds is not None:
        outside = {r: str(creds.path(pipeline.run_dir, r)) for r in OUTSIDE_ROLES}
        console.print(
            f"outside services log in with {outside['reader']} (read-only) or "
            f"{outside['producer']} (prompts only)",
            highlight=False,
            soft_wrap=True,
        )
    with contextlib.suppress(OSError, ValueError):
        record = json.loads(path.read_text())
        record["url"] = url
        # relative to the run folder, which an outside service is given
        record["credentials"] = {r: f"{CREDENTIALS_DIR}/{r}.json" for r in outside} or None
        path.write_text(json.dumps(record, indent=2) + "\n")


def _path_or_none(value: object) -> Path | None:
    return Path(str(value)) if value else None


def _finished(run_dir: Path) -> bool:
    """A run folder whose summary says the run completed."""
    try:
        return bool(json.loads((run_dir / "summary.json").read_text()).get("completed"))
    except (OSError, ValueError, AttributeError):
        return False


def _print_summary(console: Console, summary: dict[str, Any], path: Path) -> None:
    """Counts per stage in a table, then each stage's results in full (a table cell would
    cut them at the terminal's width), then the eval headline when there is one."""
    from rich.table import Table

    size = summary.get("run_dir_bytes")
    disk = f", run folder {size / 2**20:.1f} MB" if size is not None else ""
    table = Table(
        title=f"{summary['pipeline']} ({summary['run_id']}) in {summary['seconds']}s{disk}"
    )
    for column in ("stage", "processed", "published", "retried", "dead-lettered"):
        table.add_column(column)
    for name, info in summary["stages"].items():
        stats = info["stats"]
        done = info.get("done")
        table.add_row(
            name,
            str(stats["processed"] if done is None else done),
            str(stats["published"]),
            str(stats["retried"]),
            str(stats["dead_lettered"]),
        )
    console.print(table)
    for name, info in summary["stages"].items():
        results = [
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in info.items()
            if k not in ("stats", "replicas", "done", "total")
        ]
        if results:
            console.print(f"{name}: " + "  ".join(results), highlight=False, soft_wrap=True)
    for info in summary["stages"].values():
        line = eval_headline(info)
        if line:
            console.print(f"[bold]{line}[/bold]", highlight=False, soft_wrap=True)
    left = summary.get("left_in_streams")
    if left:
        from dora.pipeline.core import left_in_streams_text

        console.print(
            f"left in streams, never consumed: {left_in_streams_text(left)}",
            highlight=False,
            soft_wrap=True,
        )
    state = "completed" if summary["completed"] else "stopped before completion"
    console.print(f"{state}; summary: {path}")


def eval_headline(results: dict[str, Any]) -> str | None:
    """``eval (frozen set): greedy 0.8% -> 4.6%, gain +3.8 ± 0.7 points`` from a learner's
    results, or None when it ran no eval."""
    keys = ("start_accuracy", "final_accuracy", "gain_accuracy", "gain_accuracy_se")
    if not all(isinstance(results.get(k), int | float) for k in keys):
        return None
    start, final, gain, se = (100 * float(results[k]) for k in keys)
    return (
        f"eval (frozen held-out set): greedy {start:.1f}% -> {final:.1f}%, "
        f"gain {gain:+.1f} ± {se:.1f} points (SE clustered by problem)"
    )


RUN_FILE = "run.json"
"""Written at start: what ``--resume`` needs to continue the same run."""


def _resume_target(run_dir: Path) -> dict[str, Any]:
    """Pipeline file, run id, NATS URL and overrides of an earlier run, from its ``run.json``."""
    path = run_dir / RUN_FILE
    if not path.is_file():
        raise typer.BadParameter(f"{run_dir} has no {RUN_FILE}; is it a dora run directory?")
    return json.loads(path.read_text())


def cli(
    pipeline: Annotated[
        Path | None,
        typer.Argument(help="Pipeline YAML file, e.g. pipelines/quickstart.yaml."),
    ] = None,
    nats: Annotated[
        str | None,
        typer.Option(
            "--nats",
            help="NATS URL (tls://... for TLS); default: an embedded server with per-run "
            "credentials in RUN_DIR/credentials.",
        ),
    ] = None,
    nats_creds: Annotated[
        Path | None,
        typer.Option(
            "--nats-creds",
            help="Login for --nats: JSON with user and password, or a NATS .creds file.",
        ),
    ] = None,
    nats_ca: Annotated[
        Path | None, typer.Option("--nats-ca", help="CA certificate for a tls:// --nats URL.")
    ] = None,
    nats_host: Annotated[
        str | None,
        typer.Option(
            "--nats-host",
            help="The embedded server's address (default 127.0.0.1): this machine's address "
            "on the cluster network when stages on other machines (--ray) must reach it.",
        ),
    ] = None,
    run_dir: Annotated[
        Path | None, typer.Option("--run-dir", help="Run directory; default runs/<run_id>.")
    ] = None,
    run_id: Annotated[
        str | None, typer.Option("--run-id", help="Run id (prefixes every subject).")
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            "--resume",
            help="Continue the run in this directory (same run id, streams and checkpoints).",
        ),
    ] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="STAGE.path.to.field=VALUE (STAGE: a stage's name or type; VALUE read as "
            "YAML), e.g. --set generator.replicas=3; repeatable.",
        ),
    ] = None,
    max_steps: Annotated[
        int | None,
        typer.Option(
            "--max-steps", min=1, help="Learner steps (and the LR schedule's length) for this run."
        ),
    ] = None,
    smoke: Annotated[
        bool,
        typer.Option(
            "--smoke",
            help=f"A short run that checks the pipeline end to end: {SMOKE_STEPS} learner steps "
            "(unless --max-steps), no held-out eval.",
        ),
    ] = False,
    log_level: Annotated[
        str,
        typer.Option(
            "--log-level",
            help="Lowest level of log lines on the console: debug, info, warning, error (every "
            "line at info and above goes to RUN_DIR/log.jsonl regardless).",
        ),
    ] = "warning",
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Console: errors only, no progress view.")
    ] = False,
    json_logs: Annotated[
        bool, typer.Option("--json-logs", help="Console log lines as JSON objects.")
    ] = False,
    processes: Annotated[
        bool,
        typer.Option(
            "--processes",
            help="One OS process per stage replica (`dora stage serve`), supervised: output "
            "prefixed by stage, a dead process restarted.",
        ),
    ] = False,
    use_ray: Annotated[
        bool,
        typer.Option(
            "--ray",
            help="Each stage replica as a Ray actor, placed by each stage's `resources` and "
            "`placement` (extra `ray`); a local Ray instance unless --ray-address.",
        ),
    ] = False,
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray-address",
            help="With --ray: the Ray cluster to join (ray://... or HOST:PORT, or 'auto').",
        ),
    ] = None,
) -> None:
    """Run a pipeline until its finite stages finish (or Ctrl-C), with live progress."""
    from rich.console import Console

    from dora.pipeline import PipelineConfigError, PipelineError, load_pipeline

    console = Console()
    if smoke and resume is None:
        max_steps = max_steps or SMOKE_STEPS
        overrides = [*(overrides or ()), *SMOKE_OVERRIDES]
    if resume is not None:
        if overrides or max_steps is not None:
            raise typer.BadParameter(
                "--resume continues a run with its own --set/--max-steps/--smoke"
            )
        info = _resume_target(resume)
        pipeline, run_id = Path(info["pipeline"]), str(info["run_id"])
        run_dir, nats = resume, nats or info.get("nats")
        nats_creds = nats_creds or _path_or_none(info.get("nats_creds"))
        nats_ca = nats_ca or _path_or_none(info.get("nats_ca"))
        overrides, max_steps = info.get("overrides") or [], info.get("max_steps")
        processes = processes or bool(info.get("processes"))  # as it ran
        use_ray = use_ray or bool(info.get("ray"))
        nats_host = nats_host or info.get("nats_host")
        ray_address = ray_address or info.get("ray_address")
    if pipeline is None:
        raise typer.BadParameter("give a PIPELINE file, or --resume RUN_DIR")
    if use_ray and processes:
        raise typer.BadParameter("--ray and --processes are two deployments: pick one")
    if ray_address and not use_ray:
        raise typer.BadParameter("--ray-address is for --ray")
    if nats_host and nats:
        raise typer.BadParameter("--nats-host is where the embedded server listens; --nats "
                                 "names a server of your own")  # fmt: skip
    if (nats_creds or nats_ca) and not nats:
        raise typer.BadParameter("--nats-creds and --nats-ca log in to a --nats server")
    try:
        auth = NatsAuth.from_options(nats_creds, nats_ca)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    try:
        pipe = load_pipeline(
            pipeline,
            run_id=run_id,
            nats_url=nats,
            nats_auth=auth,
            nats_host=nats_host or "127.0.0.1",
            run_dir=run_dir,
            overrides=overrides or (),
            max_steps=max_steps,
        )
    except PipelineConfigError as exc:
        console.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
        raise typer.Exit(2) from exc
    if resume is None and _finished(pipe.run_dir):
        console.print(
            f"[red]error:[/red] run {pipe.run_id} already finished in {pipe.run_dir} (its "
            "prompts were all consumed, so it would wait forever); pick another --run-id",
            highlight=False,
        )
        raise typer.Exit(2)
    console.print(f"run [bold]{pipe.run_id}[/bold] -> {pipe.run_dir}")
    pipe.run_dir.mkdir(parents=True, exist_ok=True)
    level = "error" if quiet else log_level.lower()
    if level not in LEVELS:
        raise typer.BadParameter(
            f"--log-level must be one of {', '.join(LEVELS)}, got {log_level!r}"
        )
    log_file = configure_logs(
        pipe.run_dir,
        level,  # type: ignore[arg-type]
        console_json=json_logs,
        file_level="debug" if level == "debug" else "info",
    )
    console.print(f"log -> {log_file}", highlight=False)
    record = {
        "pipeline": str(pipeline.resolve()),
        "run_id": pipe.run_id,
        "nats": nats,
        "nats_creds": str(nats_creds.resolve()) if nats_creds else None,
        "nats_ca": str(nats_ca.resolve()) if nats_ca else None,
        "overrides": list(overrides or ()),
        "max_steps": max_steps,
        "processes": processes,
        "nats_host": nats_host,
        "ray": use_ray,
        "ray_address": ray_address,
    }
    (pipe.run_dir / RUN_FILE).write_text(json.dumps(record, indent=2) + "\n")
    received: list[int] = []
    try:
        if processes:
            from dora.pipeline.processes import ProcessRun

            supervisor = ProcessRun(
                pipe,
                pipeline,
                overrides=list(overrides or ()),
                max_steps=max_steps,
                log_level=level,
                echo=lambda line: console.print(
                    line, markup=False, highlight=False, soft_wrap=True
                ),
            )
            summary = asyncio.run(_run_processes(supervisor, console, received, quiet=quiet))
        elif use_ray:
            summary = _run_on_ray(pipe, pipeline, ray_address, overrides, max_steps, level,
                                  console, received, quiet)  # fmt: skip
        else:
            summary = asyncio.run(_run(pipe, console, received, quiet=quiet))
    except (asyncio.CancelledError, interrupt.Interrupted):
        console.print("[yellow]interrupted[/yellow]")
        raise typer.Exit(128 + (received[0] if received else signal.SIGINT)) from None
    except PipelineError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(1) from exc
    _print_summary(console, summary, pipe.run_dir / "summary.json")
    if received:  # drained and summarized, but stopped early: say so in the exit status
        console.print(f"[yellow]stopped by signal {received[0]}; resume with --resume")
        raise typer.Exit(128 + received[0])
