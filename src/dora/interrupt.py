"""A process-wide stop request that blocking work in threads can see.

``asyncio`` delivers Ctrl-C to the event loop, but a warm start or an evaluation runs in a
worker thread that a task cancellation cannot reach: the thread would run to its end first
(minutes). The CLI's signal handler calls ``request()``; long loops call ``check()`` between
steps and stop with ``Interrupted`` within one step.
"""

from __future__ import annotations

import threading

_requested = threading.Event()


class Interrupted(RuntimeError):
    """The user asked the process to stop (SIGINT or SIGTERM)."""


def request() -> None:
    """Ask every ``check()``-ing loop of this process to stop."""
    _requested.set()


def clear() -> None:
    """Forget a request (a new run in the same process, or a test)."""
    _requested.clear()


def check() -> None:
    """Raise ``Interrupted`` if a stop was requested."""
    if _requested.is_set():
        raise Interrupted("stop requested")
