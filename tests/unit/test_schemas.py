"""schemas/ matches the models; events round-trip JSON; the schemas accept real event JSON and
reject what the models reject (unknown fields, another schema_version)."""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from dora import events
from dora.cli import app
from dora.contract import FAMILY_EVENTS, render_markdown
from dora.schemas import CONTRACT_FILE, check, expected_files, export
from dora.subjects import DURABLE_FAMILIES, LIVE_FAMILIES, Subjects

REPO_SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def _value(annotation: Any) -> Any:
    """A small valid value for a field annotation (enough for every current wire type)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _value(args[0])
    if origin is typing.Literal:
        return args[0]
    if origin in (typing.Union, types.UnionType):
        real = [a for a in args if a is not type(None)]
        return None if len(real) < len(args) else _value(real[0])
    if origin is tuple:
        return () if len(args) == 2 and args[1] is Ellipsis else tuple(_value(a) for a in args)
    if origin is dict:
        return {}
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return sample(annotation)
    return {str: "x", int: 1, float: 1.0, bool: True}[annotation]


def sample(cls: type[BaseModel], **overrides: Any) -> Any:
    """An instance of ``cls`` with every required field filled generically."""
    values = {
        name: _value(f.annotation)
        for name, f in cls.model_fields.items()
        if f.is_required() and name not in overrides
    }
    return cls(**values, **overrides)


def trajectory(i: int = 0, run_version: int = 3) -> events.Trajectory:
    """A realistic trajectory (about the size of a short real one)."""
    prompt = events.Prompt(prompt_id=f"p{i}", text=f"What is {i} + 2?", answer=str(i + 2))
    request = events.RolloutRequest(
        request_id=f"r{i}", prompt=prompt, group_id=f"g{i}", group_index=0, version=run_version
    )
    completion = tuple(range(10, 40))
    return events.Trajectory(
        request=request,
        version=run_version,
        prompt_token_ids=(1, 2, 3, 4),
        completion_token_ids=completion,
        logprobs=tuple(-0.5 for _ in completion),
        loss_mask=tuple(1 for _ in completion),
        text=f"{i + 2}",
        finish_reason="stop",
        engines=("e0",),
    )


def _validator(name: str) -> jsonschema.protocols.Validator:
    schema = json.loads((REPO_SCHEMAS / name).read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def test_committed_schemas_are_up_to_date() -> None:
    result = check(REPO_SCHEMAS)
    assert result.ok, "schemas/ is stale: run `dora schemas export`\n" + "\n".join(
        result.problems()
    )


def test_export_is_deterministic_and_check_names_each_problem(tmp_path: Path) -> None:
    export(tmp_path)
    first = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    export(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == first
    assert set(first) == {f"{cls.__name__}.json" for cls in events.WIRE_TYPES} | {CONTRACT_FILE}
    assert check(tmp_path).ok

    (tmp_path / CONTRACT_FILE).write_text("# edited by hand\n")
    assert check(tmp_path).stale == [CONTRACT_FILE]  # the contract page cannot drift either
    export(tmp_path)

    (tmp_path / "Trajectory.json").write_text("{}\n")
    (tmp_path / "Prompt.json").unlink()
    (tmp_path / "Gone.json").write_text("{}\n")
    result = check(tmp_path)
    assert (result.stale, result.missing, result.extra) == (
        ["Trajectory.json"],
        ["Prompt.json"],
        ["Gone.json"],
    )
    runner = CliRunner()
    failed = runner.invoke(app, ["schemas", "check", "--dir", str(tmp_path)])
    assert failed.exit_code == 1
    for name in ("Trajectory.json", "Prompt.json", "Gone.json", "dora schemas export"):
        assert name in failed.output
    fixed = runner.invoke(app, ["schemas", "export", "--dir", str(tmp_path)])
    assert fixed.exit_code == 0
    assert check(tmp_path).ok
    assert not (tmp_path / "Gone.json").exists()


@pytest.mark.parametrize("cls", events.WIRE_TYPES, ids=lambda c: c.__name__)
def test_every_event_round_trips_json_and_matches_its_schema(cls: type[events.Event]) -> None:
    event = sample(cls)
    wire = event.model_dump_json()
    assert cls.model_validate_json(wire) == event
    _validator(f"{cls.__name__}.json").validate(json.loads(wire))


def test_schema_accepts_a_real_trajectory_and_rejects_what_the_model_rejects() -> None:
    validator = _validator("Trajectory.json")
    good = json.loads(trajectory(7).model_dump_json())
    validator.validate(good)

    unknown = {**good, "surprise": 1}
    nested_unknown = {**good, "request": {**good["request"], "surprise": 1}}
    wrong_version = {**good, "schema_version": 2}
    missing = {k: v for k, v in good.items() if k != "finish_reason"}
    bad_reason = {**good, "finish_reason": "bored"}
    for bad in (unknown, nested_unknown, wrong_version, missing, bad_reason):
        assert not validator.is_valid(bad)
        with pytest.raises(ValueError):
            events.Trajectory.model_validate_json(json.dumps(bad))


def test_expected_files_cover_every_wire_type() -> None:
    names = set(expected_files())
    assert names == {f"{cls.__name__}.json" for cls in events.WIRE_TYPES} | {CONTRACT_FILE}


def test_the_contract_page_names_every_family_and_its_stream() -> None:
    page = render_markdown()
    for family in (*DURABLE_FAMILIES, *LIVE_FAMILIES):
        assert f"`dora.RUN.{family}" in page
    for family in DURABLE_FAMILIES:
        assert f"`{Subjects('RUN').stream(family)}`" in page
    assert set(FAMILY_EVENTS) | {"replay", "control", "rpc"} == {*DURABLE_FAMILIES, *LIVE_FAMILIES}
