"""Named crash points: a process kills itself with SIGKILL at an exact moment, for kill tests.

A test that signals a process from outside hits a chosen moment (a migration half done, a
learner step taken but its weights not yet published) only by chance. With
``DORA_CRASH_AT=<point>[:<n>][,<point>[:<n>]...]`` a process SIGKILLs itself the ``n``-th
time (default: the first) it reaches ``crash_point(<point>)``. With
``DORA_CRASH_ONCE=<folder>`` the file ``<folder>/<point>`` is created then, and a process that
finds it runs through that point (the restarted one). No cleanup runs, as with a real
``kill -9``. Unset, a crash point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

ENV_AT = "DORA_CRASH_AT"
ENV_ONCE = "DORA_CRASH_ONCE"

POINTS = (
    "learner.after_optimizer_step",  # stepped; nothing journaled, published or acked
    "learner.before_publish",  # stepped and journaled; the new version not yet published
    "learner.after_publish",  # the new version published; the step not yet reported
    "orchestrator.after_export",  # mid-migration: exported, not yet imported
)
"""Where ``crash_point`` is called (``DORA_CRASH_AT`` names some of these)."""


def parse(value: str) -> dict[str, int]:
    """``"a:3,b"`` -> ``{"a": 3, "b": 1}``; an unknown point is an error naming the known."""
    points: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, _, nth = item.partition(":")
        if name not in POINTS:
            raise ValueError(f"{ENV_AT}: {name!r} is not a crash point; known: {', '.join(POINTS)}")
        points[name] = int(nth or 1)
    return points


_countdown = parse(os.environ.get(ENV_AT, ""))


def crash_point(name: str) -> None:
    """SIGKILL this process here if ``DORA_CRASH_AT`` names this point (see module doc)."""
    left = _countdown.get(name)
    if left is None:
        return
    _countdown[name] = left - 1
    if left > 1:
        return
    del _countdown[name]
    folder = os.environ.get(ENV_ONCE)
    if folder:
        try:
            os.close(os.open(Path(folder) / name, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return  # crashed here once already: this is the restarted process
    os.kill(os.getpid(), signal.SIGKILL)
