"""Stage types by name, for YAML pipelines: built-ins, registered ones, or ``module:attr``.

Built-ins are listed as import strings so that looking a name up imports only that stage.
An entry resolves to a ``Stage`` subclass (instantiated with the YAML ``config``) or a
``Stage`` instance such as an ``@stage`` function (cloned with the YAML ``config``).
"""

from __future__ import annotations

import importlib
from typing import Any

from dora.stage import RetryPolicy, Stage, StageError

BUILTIN_STAGES: dict[str, str] = {
    "prompt_source": "dora.stages.prompt_source:PromptSource",
    "rule_generator": "dora.stages.rule_generator:RuleGenerator",
    "verifier": "dora.stages.verifier:VerifierStage",
    "counting_sink": "dora.stages.counting_sink:CountingSink",
    "rollout": "dora.stages.rollout:RolloutStage",
    "dispatcher": "dora.stages.dispatcher:DispatcherStage",
    "generator": "dora.stages.generator:GeneratorStage",
    "orchestrator": "dora.stages.orchestrator:OrchestratorStage",
    "learner": "dora.stages.learner:LearnerStage",
    "recorder": "dora.stages.recorder:RecorderStage",
    "environment": "dora.stages.environment:EnvironmentStage",
}
_registered: dict[str, type[Stage] | Stage] = {}


class UnknownStageType(StageError):
    """A stage type that is neither registered nor an importable ``module:attr``."""


def register_stage(name: str) -> Any:
    """Decorator: make a Stage subclass (or ``@stage`` instance) available under ``name``."""

    def wrap(target: type[Stage] | Stage) -> type[Stage] | Stage:
        _registered[name] = target
        return target

    return wrap


def stage_types() -> list[str]:
    """Every registered name, sorted."""
    return sorted({*BUILTIN_STAGES, *_registered})


def _import(ref: str) -> Any:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise UnknownStageType(f"{ref!r} is not of the form 'package.module:attr'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownStageType(f"cannot import module {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise UnknownStageType(f"module {module_name!r} has no attribute {attr!r}") from exc


def resolve_stage(ref: str) -> type[Stage] | Stage:
    """The stage class or instance named ``ref`` (a registered name or ``module:attr``)."""
    if ref in _registered:
        return _registered[ref]
    if ref in BUILTIN_STAGES:
        target = _import(BUILTIN_STAGES[ref])
    elif ":" in ref:
        target = _import(ref)
    else:
        raise UnknownStageType(
            f"unknown stage type {ref!r}; registered: {', '.join(stage_types())} "
            "(or give an import path 'package.module:attr')"
        )
    if not (isinstance(target, Stage) or (isinstance(target, type) and issubclass(target, Stage))):
        raise UnknownStageType(f"{ref!r} is {type(target).__name__}, not a Stage class or stage")
    return target


def build_stage(
    ref: str,
    *,
    name: str | None = None,
    concurrency: int | None = None,
    retry: RetryPolicy | None = None,
    consumes: str | None = None,
    config: dict[str, Any] | None = None,
) -> Stage:
    """Instantiate stage type ``ref`` with its config (pydantic ``ValidationError`` if bad)."""
    target = resolve_stage(ref)
    if isinstance(target, Stage):
        return target.clone(
            name=name, concurrency=concurrency, retry=retry, consumes=consumes, config=config or {}
        )
    kwargs: dict[str, Any] = {
        "name": name,
        "concurrency": concurrency,
        "retry": retry,
        "consumes": consumes,
    }
    return target(**{k: v for k, v in kwargs.items() if v is not None}, **(config or {}))
