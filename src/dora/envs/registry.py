"""Environments by name, as tasks and verifiers are: ``make_environment("calculator")``.

A factory builds a fresh environment for every episode (one instance per episode), from a
validated config; a bad field is refused at load, naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from dora.envs.base import Environment
from dora.tasks.base import TaskConfigError, validate_config


class EnvironmentConfig(BaseModel):
    """Fields every environment accepts; subclasses add their own. Unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_turns: int = 8


C = TypeVar("C", bound=EnvironmentConfig)
_REGISTRY: dict[str, tuple[type[EnvironmentConfig], Callable[[Any], Environment]]] = {}


def register_environment(
    name: str, config_cls: type[C], factory: Callable[[C], Environment], *, replace: bool = False
) -> None:
    """Make ``make_environment(name, **config)`` build ``factory(config_cls(**config))``."""
    if name in _REGISTRY and not replace:
        raise TaskConfigError(f"environment {name!r} is already registered")
    _REGISTRY[name] = (config_cls, factory)


def environment_names() -> list[str]:
    return sorted(_REGISTRY)


def make_environment(name: str, **config: Any) -> Environment:
    """A fresh environment for one episode (the config is validated; bad fields are named)."""
    if name not in _REGISTRY:
        raise TaskConfigError(f"unknown environment {name!r}; choose one of {environment_names()}")
    config_cls, factory = _REGISTRY[name]
    return factory(validate_config(config_cls, config, f"environment {name!r}"))
