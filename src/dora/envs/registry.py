"""Environments by name, as tasks and verifiers are: ``make_environment("calculator")``.

A factory builds a fresh environment for every episode (one instance per episode), from a
validated config; a bad field is refused at load, naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from dora.envs.base import Environment
from dora.named import Named
from dora.tasks.base import TaskConfigError


class EnvironmentConfig(BaseModel):
    """Fields every environment accepts; subclasses add their own. Unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_turns: int = 8


C = TypeVar("C", bound=EnvironmentConfig)
_ENVIRONMENTS: Named[Environment] = Named("environment", TaskConfigError)


def register_environment(
    name: str, config_cls: type[C], factory: Callable[[C], Environment], *, replace: bool = False
) -> None:
    """Make ``make_environment(name, **config)`` build ``factory(config_cls(**config))``."""
    _ENVIRONMENTS.register(name, config_cls, factory, replace=replace)


def environment_names() -> list[str]:
    return _ENVIRONMENTS.names()


def make_environment(name: str, **config: Any) -> Environment:
    """A fresh environment for one episode (the config is validated; bad fields are named)."""
    return _ENVIRONMENTS.make(name, **config)
