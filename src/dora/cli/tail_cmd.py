"""``dora tail SUBJECT``: watch the events of a running pipeline, pretty-printed.

Durable subjects are read from their stream without consuming anything (``Bus.stream_messages``:
no consumer, no acks, work queues keep their work); live ones (status, control, rpc) through a
plain subscription. Payloads are parsed with the ``dora.events`` models; what does not parse is
shown raw with the reason, never hidden.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel, TypeAdapter, ValidationError
from rich.console import Console
from rich.text import Text

from dora import events
from dora.bus.auth import CREDENTIALS_DIR, NatsAuth
from dora.contract import FAMILY_EVENTS
from dora.subjects import DURABLE_FAMILIES, Subjects

_SKIP = {"event_id", "schema_version", "created_at"}
_BULK = {"prompt_token_ids", "completion_token_ids", "logprobs", "loss_mask", "token_versions"}
_MAX_VALUE = 48


def parse(family: str, data: bytes) -> tuple[BaseModel | None, str]:
    """The event in ``data`` (the family's type first, then every wire type), or the reason."""
    candidates = [FAMILY_EVENTS[family]] if family in FAMILY_EVENTS else []
    candidates += [t for t in events.WIRE_TYPES if t not in candidates]
    first_error = ""
    for cls in candidates:
        try:
            return TypeAdapter(cls).validate_json(data), ""
        except ValidationError as exc:
            if not first_error:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err["loc"]) or "payload"
                first_error = f"{cls.__name__}: {where}: {err['msg']}"
    return None, first_error or "no wire type"


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= _MAX_VALUE else text[: _MAX_VALUE - 1] + "…"


def summary(event: BaseModel) -> dict[str, str]:
    """The fields worth a glance: scalars, sizes of sequences, ids of nested events."""
    out: dict[str, str] = {}
    if isinstance(event, events.Trajectory | events.ScoredTrajectory):
        traj = event if isinstance(event, events.Trajectory) else event.trajectory
        out["request"] = traj.request.request_id
        out["version"] = str(traj.version)
        out["tokens"] = f"{len(traj.prompt_token_ids)}+{len(traj.completion_token_ids)}"
        out["finish"] = traj.finish_reason
        out["migrations"] = str(len(traj.migrations))
    for name, value in event:
        if name in _SKIP or name in _BULK or name in out:
            continue
        if isinstance(value, BaseModel):
            ident = next(
                (getattr(value, k) for k in ("request_id", "prompt_id") if hasattr(value, k)), None
            )
            if ident is not None:
                out[name] = str(ident)
        elif isinstance(value, tuple | list | dict):
            if value:
                out[name] = (
                    f"[{len(value)}]"
                    if len(value) > 4
                    else _short(list(value) if not isinstance(value, dict) else value)
                )
        elif value not in ("", None):
            out[name] = _short(value)
    return out


def render(subject: str, data: bytes, family: str, seq: int = 0, raw: bool = False) -> Text:
    """One line for one message: ``#seq subject Kind key=value ...`` (or the raw payload)."""
    line = Text()
    if seq:
        line.append(f"#{seq} ", style="dim")
    line.append(subject, style="cyan")
    line.append(" ")
    payload = data.decode("utf-8", errors="replace")
    if raw:
        line.append(payload)
        return line
    event, reason = parse(family, data)
    if event is None:
        line.append("INVALID ", style="bold red")
        line.append(f"({reason}) ", style="red")
        line.append(_short(payload) if len(payload) > 200 else payload)
        return line
    line.append(type(event).__name__, style="bold green")
    for key, value in summary(event).items():
        line.append(f" {key}=", style="dim")
        line.append(value)
    return line


async def _messages(
    url: str, subjects: Subjects, pattern: str, from_start: bool, auth: NatsAuth | None
) -> AsyncIterator[tuple[str, bytes, int]]:
    from dora.bus import NatsBus

    bus = NatsBus(subjects, url, create_streams=False, reconnect_attempts=25, auth=auth)  # ~5 s
    await bus.connect()
    try:
        if subjects.family_of(pattern) in DURABLE_FAMILIES:
            start = "first" if from_start else "new"
            async for stored in bus.stream_messages(pattern, start=start, follow=True):
                yield stored.subject, stored.data, stored.stream_seq
        else:
            sub = await bus.subscribe(pattern)
            async for msg in sub:
                yield msg.subject, msg.data, 0
    finally:
        await bus.close()


async def tail(
    url: str,
    subject: str,
    run: str,
    *,
    from_start: bool = False,
    raw: bool = False,
    max_count: int = 0,
    console: Console | None = None,
    auth: NatsAuth | None = None,
) -> int:
    """Print the messages of ``subject`` until ``max_count`` (0: forever); returns the count."""
    subjects = Subjects(run)
    pattern = subjects.resolve(subject)
    family = subjects.family_of(pattern)
    console = console or Console()
    count = 0
    async for subj, data, seq in _messages(url, subjects, pattern, from_start, auth):
        console.print(render(subj, data, family, seq, raw), soft_wrap=True)
        count += 1
        if max_count and count >= max_count:
            break
    return count


def find_run(subject: str, run: str | None) -> str:
    """The run id: ``--run``, or the second token of a full subject."""
    if run:
        return run
    if subject.startswith("dora."):
        return subject.split(".")[1]
    raise typer.BadParameter("give --run RUN_ID (or a full subject dora.<run>.<family>...)")


def find_url(nats_url: str | None, run: str, runs_dir: Path) -> str:
    """``--nats``, else the embedded server of ``runs/<run>`` (its ports file), else an error."""
    from dora.bus.server import running_server_url

    if nats_url:
        return nats_url
    for store in (runs_dir / run / "nats", runs_dir / run):
        url = running_server_url(store)
        if url:
            return url
    raise typer.BadParameter(
        f"no running nats-server found under {runs_dir / run} (is the run live?); give --nats URL"
    )


def find_auth(creds: Path | None, run: str, runs_dir: Path, embedded: bool) -> NatsAuth | None:
    """``--nats-creds``, else the read-only login of the run's embedded server (its folder's
    ``credentials/reader.json``), else none."""
    if creds is not None:
        return NatsAuth.from_file(creds)
    reader = runs_dir / run / CREDENTIALS_DIR / "reader.json"
    return NatsAuth.from_file(reader) if embedded and reader.is_file() else None


def cli(
    subject: Annotated[
        str,
        typer.Argument(help="Family (trajectories, scored, deadletter, status, ...) or subject."),
    ],
    nats_url: Annotated[
        str | None, typer.Option("--nats", envvar="DORA_NATS_URL", help="NATS server URL.")
    ] = None,
    run: Annotated[str | None, typer.Option("--run", help="Run id (for family names).")] = None,
    from_start: Annotated[
        bool, typer.Option("--from-start", help="Durable subjects: begin with the oldest stored.")
    ] = False,
    raw: Annotated[bool, typer.Option("--raw", help="Print payloads as received.")] = False,
    max_count: Annotated[int, typer.Option("--max", help="Stop after N messages (0: never).")] = 0,
    runs_dir: Annotated[Path, typer.Option("--runs-dir", help="Where run folders live.")] = Path(
        "runs"
    ),
    nats_creds: Annotated[
        Path | None,
        typer.Option(
            "--nats-creds",
            help="Login (JSON user/password or .creds); default: the run folder's reader login.",
        ),
    ] = None,
) -> None:
    """Live, pretty-printed events of a running pipeline."""
    run_id = find_run(subject, run)
    url = find_url(nats_url, run_id, runs_dir)
    try:
        auth = find_auth(nats_creds, run_id, runs_dir, nats_url is None)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--nats-creds") from exc
    try:
        Subjects(run_id).resolve(subject)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="SUBJECT") from exc
    import nats.errors

    from dora.bus import BusError

    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(
                tail(
                    url,
                    subject,
                    run_id,
                    from_start=from_start,
                    raw=raw,
                    max_count=max_count,
                    auth=auth,
                )
            )
    except BusError as exc:
        typer.echo(f"dora tail: {exc}", err=True)
        raise typer.Exit(1) from exc
    except (OSError, nats.errors.Error) as exc:
        typer.echo(
            f"dora tail: NATS server at {url} unreachable or gone ({type(exc).__name__})", err=True
        )
        raise typer.Exit(1) from exc
