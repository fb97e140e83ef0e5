"""Pipelines as YAML files (``pipelines/*.yaml``), validated before anything starts.

Schema::

    name: quickstart                 # optional, default: the file stem
    run_id: null                     # optional; default <name>-<utc time>-<hex>
    nats: null                       # optional NATS URL; none = embedded nats-server
    stream_max_msgs: 100000          # optional backpressure bound of work streams
    drain_timeout_s: 30              # optional
    stall_timeout_s: 600             # optional; fail a run that makes no progress this long
    replay:                          # optional: keep copies for late readers (CONTRACT.md)
      families: [trajectories, scored]
      max_age_s: 86400               # the oldest copies go first after this, or
      max_bytes: -1                  # beyond this size (-1: unbounded)
    stages:                          # at least one
      - type: prompt_source          # registry name (dora.registry) or package.module:attr
        name: prompts                # optional, default: the stage's own name
        replicas: 1                  # optional
        concurrency: 4               # optional override
        consumes: requests.v3        # optional override of the input subject reference
        retry: {max_deliver: 5, backoff_s: 0.5, backoff_factor: 2, max_backoff_s: 30,
                ack_wait_s: 30}      # optional override, every key optional
        config: {task: arithmetic, count: 32}   # validated by the stage's Config model
        resources: {num_cpus: 1, num_gpus: 1, custom: {engine: 1}}   # optional, --ray only
        placement: spread            # optional, --ray only: pack, spread, strict_pack,
                                     # strict_spread (one placement group over the replicas)
    x-shared: &shared {...}          # optional: any top-level key starting with "x-" is
                                     # ignored, a home for YAML anchors stated once

Every error names the file and the field, e.g. ``quickstart.yaml: stages[1].config.count:
Input should be a valid integer``; an unknown type lists the registered ones.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dora.bus import Bus
from dora.bus.auth import NatsAuth
from dora.pipeline.core import Pipeline
from dora.pipeline.overrides import OverrideError, apply_overrides, max_steps_overrides
from dora.registry import UnknownStageType, build_stage
from dora.stage import RetryPolicy, StageError, resolve_subject
from dora.stages.replay_writer import ReplaySettings
from dora.subjects import Subjects


class PipelineConfigError(ValueError):
    """A pipeline file that cannot be used; the message names the file and the field."""


class RetrySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_deliver: int = Field(default=5, ge=1)
    backoff_s: float = Field(default=0.5, ge=0)
    backoff_factor: float = Field(default=2.0, ge=1)
    max_backoff_s: float = Field(default=30.0, ge=0)
    ack_wait_s: float = Field(default=30.0, gt=0)


class StageResources(BaseModel):
    """One replica's Ray resources: CPUs, GPUs, memory and custom resources (``node_type``,
    ``accelerator``...), as ``ray.remote`` takes them."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(default=1.0, ge=0)
    num_gpus: float = Field(default=0.0, ge=0)
    memory: int | None = Field(default=None, ge=0, description="Bytes.")
    custom: dict[str, float] = Field(default_factory=dict)


Placement = Literal["pack", "spread", "strict_pack", "strict_spread"]


class StageEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: str = Field(min_length=1)
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]+$")
    replicas: int = Field(default=1, ge=1)
    concurrency: int | None = Field(default=None, ge=1)
    consumes: str | None = Field(default=None, min_length=1, description="Input subject ref.")
    retry: RetrySpec | None = None
    resources: StageResources | None = None
    """Under ``dora run --ray``: what each replica's actor needs (ignored otherwise)."""
    placement: Placement | None = None
    """Under ``dora run --ray``: a placement group over the replicas (spread engines over
    nodes, pack a tensor-parallel group on one); none: Ray places each actor alone."""
    config: dict[str, Any] = Field(default_factory=dict)


class PipelineFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]+$")
    run_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]+$")
    nats: str | None = None
    stream_max_msgs: int = Field(default=100_000, ge=1)
    drain_timeout_s: float = Field(default=30.0, gt=0)
    stall_timeout_s: float | None = Field(default=600.0, gt=0)
    """Fail the run when no stage makes progress for this long (None: wait forever)."""
    replay: ReplaySettings | None = None
    """Keep a copy of the trajectory and scored streams for services that join late."""
    stages: list[StageEntry] = Field(min_length=1)


def _loc(prefix: str, loc: tuple[Any, ...]) -> str:
    out = prefix
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<file>"


def _errors(path: Path, prefix: str, exc: ValidationError) -> str:
    lines = [
        f"{path}: {_loc(prefix, tuple(e['loc']))}: {e['msg']}"
        for e in exc.errors(include_url=False, include_input=False)
    ]
    return "\n".join(lines)


def _unshared(value: Any) -> Any:
    """A copy in which no two places share an object: a YAML alias (``*task``) yields one
    object wherever it is used, and an override of one place must not change the others."""
    if isinstance(value, dict):
        return {k: _unshared(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unshared(v) for v in value]
    return value


def load_raw(path: Path) -> dict[str, Any]:
    """The file as plain data: ``x-`` keys (anchor homes) dropped, no object shared."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise PipelineConfigError(f"{path}: cannot read: {exc}") from exc
    except yaml.YAMLError as exc:
        raise PipelineConfigError(f"{path}: invalid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise PipelineConfigError(f"{path}: expected a mapping with a `stages` list")
    return {k: _unshared(v) for k, v in raw.items() if not str(k).startswith("x-")}


def read_pipeline_file(
    path: Path, overrides: Sequence[str] = (), max_steps: int | None = None
) -> PipelineFile:
    """Parse the file, apply ``--set`` overrides (and ``--max-steps``), and validate the
    structure (not yet the stages' configs)."""
    path = Path(path)
    raw = load_raw(path)
    try:
        extra = max_steps_overrides(raw, max_steps) if max_steps is not None else []
        raw = apply_overrides(raw, [*overrides, *extra])
    except OverrideError as exc:
        raise PipelineConfigError(f"{path}: {exc}") from exc
    try:
        return PipelineFile.model_validate(raw)
    except ValidationError as exc:
        raise PipelineConfigError(_errors(path, "", exc)) from exc


def load_pipeline(
    path: Path,
    *,
    run_id: str | None = None,
    bus: Bus | None = None,
    nats_url: str | None = None,
    nats_auth: NatsAuth | None = None,
    nats_host: str = "127.0.0.1",
    run_dir: Path | None = None,
    overrides: Sequence[str] = (),
    max_steps: int | None = None,
) -> Pipeline:
    """A ready-to-run Pipeline from a YAML file; arguments override the file's values
    (``overrides``: ``STAGE.path.to.field=VALUE``, see ``dora.pipeline.overrides``)."""
    path = Path(path)
    spec = read_pipeline_file(path, overrides, max_steps)
    name = spec.name or path.stem.replace(".", "_")
    try:
        pipeline = Pipeline(
            run_id=run_id or spec.run_id,
            bus=bus,
            name=name,
            nats_url=nats_url or spec.nats,
            nats_auth=nats_auth,
            nats_host=nats_host,
            run_dir=run_dir,
            stream_max_msgs=spec.stream_max_msgs,
            drain_timeout=spec.drain_timeout_s,
            stall_timeout=spec.stall_timeout_s,
            replay=spec.replay,
        )
    except (ValueError, StageError) as exc:
        raise PipelineConfigError(f"{path}: run_id: {exc}") from exc
    if any(":" in entry.type for entry in spec.stages):
        importable_beside(path)
    for i, entry in enumerate(spec.stages):
        where = f"stages[{i}]"
        retry = RetryPolicy(**entry.retry.model_dump()) if entry.retry else None
        try:
            stage = build_stage(
                entry.type,
                name=entry.name,
                concurrency=entry.concurrency,
                retry=retry,
                consumes=entry.consumes,
                config=entry.config,
            )
            if stage.consumes is not None:  # a misspelt subject fails here, not at start
                try:
                    resolve_subject(Subjects("check"), stage.consumes)
                except StageError as exc:
                    raise PipelineConfigError(f"{path}: {where}.consumes: {exc}") from exc
            pipeline.add(stage, replicas=entry.replicas)
        except UnknownStageType as exc:
            raise PipelineConfigError(f"{path}: {where}.type: {exc}") from exc
        except ValidationError as exc:
            raise PipelineConfigError(_errors(path, f"{where}.config", exc)) from exc
        except (StageError, TypeError) as exc:
            raise PipelineConfigError(f"{path}: {where}: {exc}") from exc
    check_one_mode(path, pipeline)
    return pipeline


def check_one_mode(path: Path, pipeline: Pipeline) -> None:
    """The rollout's stages (dispatcher, generators, orchestrator) must run one mode: a
    dispatcher tagging for ``partial`` beside a ``dora`` orchestrator would never finish."""
    modes = {
        stage.name: mode
        for stage in pipeline.stages
        if isinstance(mode := getattr(stage.config, "mode", None), str)
    }
    if len(set(modes.values())) > 1:
        each = ", ".join(f"{name}: {mode}" for name, mode in modes.items())
        raise PipelineConfigError(
            f"{path}: the rollout stages disagree on `mode` ({each}); state it once "
            "(a YAML anchor) or override every one"
        )


def importable_beside(path: Path) -> None:
    """Let ``type: mystages:my_reward`` find ``mystages.py`` next to the YAML file or in the
    working directory without PYTHONPATH (appended: installed packages still win)."""
    for folder in (str(path.resolve().parent), os.getcwd()):
        if folder not in sys.path:
            sys.path.append(folder)
