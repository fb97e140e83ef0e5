"""``dora stages [TYPE]``: the YAML reference of stage types, read from the code itself.

Without TYPE: every registered type with the first line of its docstring, what it consumes
and what it emits. With TYPE (a registered name or ``module:attr``): every field of its
``config:`` block, nested models included, with type, default and description — the same
models that validate a pipeline file, so the reference cannot drift from what is accepted.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import itertools
import textwrap
from typing import Annotated, Any, Literal, get_args, get_origin

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


def _default(field: FieldInfo) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
        return "null" if value is None else repr(value) if isinstance(value, str) else str(value)
    if field.default_factory is not None:
        try:
            value = field.default_factory()  # type: ignore[call-arg]
        except TypeError:
            return "(computed)"
        if isinstance(value, BaseModel):
            return "{...}"
        return str(value)
    return "(required)"


def _type(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return " | ".join(repr(arg) for arg in get_args(annotation))
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("NoneType", "None")


def _nested(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _nested(arg)
        if found is not None:
            return found
    return None


Row = tuple[str, str, str, str]


def _attribute_docs(cls: type) -> dict[str, str]:
    """The string under each annotated attribute of a class body (its attribute docstring)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def dataclass_rows(cls: type, prefix: str) -> list[Row]:
    """Rows of a config dataclass (the learner's, the engine's), nested dataclasses expanded."""
    docs = _attribute_docs(cls)
    rows: list[Row] = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if f.default is not dataclasses.MISSING:
            default = "null" if f.default is None else repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            default = "{...}" if dataclasses.is_dataclass(value) else repr(value)
        else:
            default = "(required)"
        rows.append((path, str(f.type), default, docs.get(f.name, "")))
        value_type = (
            type(f.default_factory()) if f.default_factory is not dataclasses.MISSING else None
        )
        if value_type is not None and dataclasses.is_dataclass(value_type):
            rows.extend(dataclass_rows(value_type, f"{path}."))
    return rows


def config_rows(model: type[BaseModel], prefix: str = "") -> list[Row]:
    """(dotted field, type, default, description) for every field, nested models expanded;
    a dict field whose ``json_schema_extra`` names ``fields: module:Class`` (a dataclass)
    lists that class's fields."""
    rows: list[Row] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        rows.append((path, _type(field.annotation), _default(field), field.description or ""))
        nested = _nested(field.annotation)
        if nested is not None and nested is not model:
            rows.extend(config_rows(nested, prefix=f"{path}."))
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        ref = extra.get("fields")
        if isinstance(ref, str):
            module, _, attr = ref.partition(":")
            rows.extend(dataclass_rows(getattr(importlib.import_module(module), attr), f"{path}."))
    return rows


def cli(
    stage_type: Annotated[
        str | None, typer.Argument(help="A stage type (e.g. learner); none: list every type.")
    ] = None,
) -> None:
    """The YAML reference: stage types, or every config field of one type."""
    from rich.console import Console
    from rich.table import Table

    from dora.registry import UnknownStageType, resolve_stage, stage_types
    from dora.stage import Stage

    console = Console()
    if stage_type is None:
        table = Table(title="stage types (dora stages TYPE: its config fields)")
        for column in ("type", "consumes", "emits", "what"):
            table.add_column(column)
        for name in stage_types():
            target = resolve_stage(name)
            cls = target if isinstance(target, type) else type(target)
            doc = (cls.__doc__ or "").strip().split("\n")[0]
            published = {*getattr(target, "emits", {}).values(), *getattr(target, "publishes", ())}
            emits = ", ".join(sorted(published)) or "-"
            table.add_row(name, getattr(target, "consumes", None) or "-", emits, doc)
        console.print(table)
        return
    try:
        target = resolve_stage(stage_type)
    except UnknownStageType as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from exc
    config = target.Config if isinstance(target, type) and issubclass(target, Stage) else None
    if config is None or not config.model_fields:
        console.print(f"{stage_type}: no config fields")
        return
    table = Table(title=f"{stage_type}: config fields")
    for column in ("field", "type", "default", "description"):
        table.add_column(column, overflow="fold")
    for row in config_rows(config):
        table.add_row(*row)
    console.print(table)
