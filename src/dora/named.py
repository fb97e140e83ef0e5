"""Things a user names in a config and dora builds: tasks, verifiers, environments.

Each kind keeps one ``Named`` registry: a name maps to a pydantic config model (unknown fields
refused) and a factory. ``make(name, **config)`` validates the config and builds; an unknown
name or a bad field raises the kind's error with one line naming it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError

T = TypeVar("T")
C = TypeVar("C", bound=BaseModel)


def config_problems(exc: ValidationError) -> str:
    """``field: message; other.field: message`` for a failed validation."""
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '<config>'}: {err['msg']}"
        for err in exc.errors()
    )


class Named(Generic[T]):
    """The registry of one kind (``kind`` names it in errors, raised as ``error``)."""

    def __init__(self, kind: str, error: type[Exception]) -> None:
        self.kind = kind
        self.error = error
        self._entries: dict[str, tuple[type[BaseModel], Callable[[Any], T]]] = {}

    def register(
        self, name: str, config_cls: type[C], factory: Callable[[C], T], *, replace: bool = False
    ) -> None:
        """Make ``make(name, **config)`` build ``factory(config_cls(**config))``."""
        if name in self._entries and not replace:
            raise self.error(f"{self.kind} {name!r} is already registered")
        self._entries[name] = (config_cls, factory)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def make(self, name: str, **config: Any) -> T:
        """Build ``name`` from ``config``. ``"module:attr"`` imports the module first (it may
        register ``name``); otherwise ``attr`` is called with the config as keywords."""
        if name not in self._entries and ":" in name:
            return self._imported(name, config)
        if name not in self._entries:
            raise self.error(f"unknown {self.kind} {name!r}; choose one of {self.names()}")
        config_cls, factory = self._entries[name]
        try:
            validated = config_cls(**config)
        except ValidationError as exc:
            what = f"{self.kind} {name!r}"
            raise self.error(f"invalid config for {what}: {config_problems(exc)}") from exc
        return factory(validated)

    def _imported(self, name: str, config: dict[str, Any]) -> T:
        module, _, attr = name.partition(":")
        try:
            target = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise self.error(f"{self.kind} {name!r}: cannot import it ({exc})") from exc
        if name in self._entries:  # the module registered it under this name
            return self.make(name, **config)
        try:
            return target(**config)  # type: ignore[no-any-return]
        except TypeError as exc:
            raise self.error(f"invalid config for {self.kind} {name!r}: {exc}") from exc
