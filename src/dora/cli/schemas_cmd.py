"""``dora schemas export|check``: keep ``schemas/`` in step with ``dora.events``."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="JSON Schema of every wire type (schemas/).", no_args_is_help=True)

DIR_OPTION = typer.Option(Path("schemas"), "--dir", help="Folder of the schema files.")


@app.command("export")
def export_cmd(directory: Path = DIR_OPTION) -> None:
    """Write one JSON Schema file per wire type and the stream contract page (CONTRACT.md),
    and remove schema files of no wire type."""
    from dora.schemas import CONTRACT_FILE, export

    written = export(directory)
    schemas = sum(p.name != CONTRACT_FILE for p in written)
    typer.echo(f"wrote {schemas} schemas and {CONTRACT_FILE} to {directory}")


@app.command("check")
def check_cmd(directory: Path = DIR_OPTION) -> None:
    """Exit non-zero, naming each file, when the schema files differ from the models."""
    from dora.schemas import FIX_HINT, check

    result = check(directory)
    if result.ok:
        typer.echo(f"{directory}: schemas are up to date")
        return
    for line in result.problems():
        typer.echo(f"{directory}/{line}", err=True)
    typer.echo(f"{directory} is out of date: {FIX_HINT}", err=True)
    raise typer.Exit(1)
