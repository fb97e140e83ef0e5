"""Small asyncio helpers shared by the long-running services."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any


async def cancel_all(tasks: Iterable[asyncio.Task[Any]], rounds: int = 20) -> None:
    """Cancel tasks and wait until they are done.

    On Python 3.11 ``asyncio.wait_for`` (used inside nats-py's fetch) can swallow a
    cancellation that races with a message arriving, so one ``cancel()`` is not always
    enough: cancel again until every task has finished.
    """
    pending = {t for t in tasks if not t.done()}
    for _ in range(rounds):
        if not pending:
            break
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.5)
    await asyncio.gather(*tasks, return_exceptions=True)
