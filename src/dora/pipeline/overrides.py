"""``--set STAGE.path.to.field=VALUE``: change a pipeline file's values from the command line.

A run is often the shipped pipeline with one or two values changed (fewer steps, another
seed, more engines). Copying the YAML to change them is how configs drift, so ``dora run``
takes overrides instead. Each names a stage (by its ``name``, else its ``type``) and a path
inside that stage's ``config`` (or ``replicas``, ``concurrency``, ``consumes``: the entry's own
keys); a path whose first part is a top-level key of the file
(``run_id``, ``drain_timeout_s``, ...) sets that key. The value is read as YAML (``5``,
``0.1``, ``true``, ``[1, 2]``, ``{a: 1}``; anything else is a string). Overrides are applied
to the parsed file before it is validated, so a wrong field fails at load exactly as it would
in the file, naming it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml

TOP_LEVEL = ("name", "run_id", "nats", "stream_max_msgs", "drain_timeout_s")
ENTRY_KEYS = ("replicas", "concurrency", "consumes")
"""Keys of a stage's entry itself, not of its ``config`` (``--set generator.replicas=3``)."""


class OverrideError(ValueError):
    """An override that cannot be applied; the message quotes it."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"learner.learner.max_steps=5"`` -> ``(["learner", "learner", "max_steps"], 5)``."""
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise OverrideError(f"--set {text!r}: expected STAGE.path.to.field=VALUE")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise OverrideError(f"--set {text!r}: the value is not valid YAML: {exc}") from exc
    return parts, value


def _stage_entry(raw: dict[str, Any], ref: str, text: str) -> dict[str, Any]:
    stages = raw.get("stages") or []
    named = [s for s in stages if isinstance(s, dict) and s.get("name") == ref]
    typed = [
        s for s in stages if isinstance(s, dict) and not s.get("name") and s.get("type") == ref
    ]
    found = named or typed
    if len(found) != 1:
        known = sorted({str(s.get("name") or s.get("type")) for s in stages if isinstance(s, dict)})
        what = "no stage" if not found else f"{len(found)} stages"
        raise OverrideError(f"--set {text!r}: {what} named {ref!r}; stages: {', '.join(known)}")
    return found[0]


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """``raw`` (a parsed pipeline file) with every override applied, in order."""
    for text in overrides:
        parts, value = parse_override(text)
        if parts[0] in TOP_LEVEL:
            if len(parts) != 1:
                raise OverrideError(f"--set {text!r}: {parts[0]!r} has no fields")
            raw[parts[0]] = value
            continue
        if len(parts) < 2:
            raise OverrideError(f"--set {text!r}: give a field of the stage, e.g. {parts[0]}.x=1")
        entry = _stage_entry(raw, parts[0], text)
        if len(parts) == 2 and parts[1] in ENTRY_KEYS:  # generator.replicas=3
            entry[parts[1]] = value
            continue
        node = entry.setdefault("config", {})
        for i, part in enumerate(parts[1:-1], start=1):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise OverrideError(f"--set {text!r}: {where} is {child!r}, not a mapping")
            node = child
        node[parts[-1]] = value
    return raw


def max_steps_overrides(raw: dict[str, Any], steps: int) -> list[str]:
    """``--max-steps N``: every learner stage's ``learner.max_steps``, and the length of its LR
    schedule where the file gives one (a cosine decay must span the run, however long)."""
    out = []
    for entry in raw.get("stages") or []:
        if not isinstance(entry, dict) or entry.get("type") != "learner":
            continue
        ref = entry.get("name") or "learner"
        out.append(f"{ref}.learner.max_steps={steps}")
        optim = (entry.get("config") or {}).get("learner", {}).get("optim", {})
        if isinstance(optim, dict) and "total_steps" in optim:
            out.append(f"{ref}.learner.optim.total_steps={steps}")
    if not out:
        raise OverrideError("--max-steps: the pipeline has no learner stage")
    return out
