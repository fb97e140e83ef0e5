"""Verifier protocol, result type and registry.

A verifier turns (completion, prompt) into a reward. It must be deterministic and must not
raise on malformed model output (that is a wrong answer, reward 0, with the reason in
``details``); it may raise on a bad prompt, which the reward service records as an error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from dora.events import Prompt
from dora.named import Named

Detail = str | int | float | bool


class VerifierError(ValueError):
    """An unknown verifier name or a bad verifier config (the message names the field)."""


@dataclass(frozen=True)
class VerifierResult:
    """Reward of one completion, whether it is correct, and what the verifier saw."""

    reward: float
    correct: bool
    details: dict[str, Detail] = field(default_factory=dict)


@runtime_checkable
class Verifier(Protocol):
    """Scores a completion against a prompt's ground truth."""

    name: str

    def verify(self, completion: str, prompt: Prompt) -> VerifierResult: ...


class VerifierConfig(BaseModel):
    """Base of verifier configs: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


_VERIFIERS: Named[Verifier] = Named("verifier", VerifierError)


def register_verifier(
    name: str,
    config_cls: type[VerifierConfig],
    factory: Callable[[Any], Verifier],
    *,
    replace: bool = False,
) -> None:
    """Make ``make_verifier(name, **config)`` build ``factory(config_cls(**config))``."""
    _VERIFIERS.register(name, config_cls, factory, replace=replace)


def verifier_names() -> list[str]:
    """Names ``make_verifier`` accepts."""
    return _VERIFIERS.names()


def make_verifier(name: str, **config: Any) -> Verifier:
    """Build a registered verifier; unknown names and bad fields raise VerifierError."""
    return _VERIFIERS.make(name, **config)


def last_answer_line(completion: str, marker: str = "answer:") -> str | None:
    """Text after the last line starting with ``marker`` (case-insensitive), else None."""
    found = None
    for line in completion.splitlines():
        stripped = line.strip()
        if stripped.lower().startswith(marker.lower()):
            found = stripped[len(marker) :].strip()
    return found
