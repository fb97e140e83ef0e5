"""The ``dora`` command line: one typer app; each command lives in its own module.

Command modules keep their heavy imports (torch, nats) inside the command body so that
``dora --help`` stays fast. A module registers itself by exposing ``cli`` (a function typer
turns into a command) or ``app`` (a sub-typer).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version

import typer

app = typer.Typer(
    name="dora",
    help="Asynchronous RL post-training: multi-version streaming rollout with KV migration.",
    no_args_is_help=True,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks: printed as tables, saved as JSON (and PNG).")
app.add_typer(bench_app, name="bench")

# name -> module that defines ``cli`` (a command) or ``app`` (a group)
COMMANDS: dict[str, str] = {
    "run": "dora.cli.run_cmd",
    "tail": "dora.cli.tail_cmd",
    "schemas": "dora.cli.schemas_cmd",
    "warmstart": "dora.cli.warmstart_cmd",
    "report": "dora.cli.report_cmd",
    "stages": "dora.cli.stages_cmd",
    "stage": "dora.cli.stage_cmd",
    "sim": "dora.cli.sim_cmd",
    "eval": "dora.cli.eval_cmd",
}
BENCHMARKS: dict[str, str] = {
    "bus": "dora.bench.bus",
    "episodes": "dora.bench.episodes",
    "engine": "dora.bench.engine",
    "migrate": "dora.bench.migrate",
    "modes": "dora.bench.modes",
    "plan": "dora.bench.plan",
    "weights": "dora.bench.weights",
}


def _version() -> str:
    try:
        return _dist_version("dora-rl")
    except PackageNotFoundError:  # running from a source tree without install
        import dora

        return dora.__version__


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"dora {_version()}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version."
    ),
) -> None:
    """dora: asynchronous RL post-training of language models."""


def _register(target: typer.Typer, table: dict[str, str]) -> None:
    for name, module_name in table.items():
        module = importlib.import_module(module_name)
        if hasattr(module, "app"):
            target.add_typer(module.app, name=name)
        else:
            target.command(name)(module.cli)


_register(app, COMMANDS)
_register(bench_app, BENCHMARKS)
