"""The recorder stage: writes every event of the run to ``<run_dir>/events`` and, at the end,
renders ``report.png`` (engines x time by version, migrations, staleness, reward, throughput).

Put it first in the pipeline so its consumers exist before any event is published.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from dora.events import Event
from dora.stage import Context, Stage


class RecorderStage(Stage):
    """Runs a ``RunRecorder`` for the whole run; renders the report on teardown."""

    name = "recorder"

    async def setup(self, ctx: Context) -> None:
        from dora.audit import RunRecorder

        self.run_dir = Path(ctx.run_dir or Path("runs") / ctx.run_id)
        self.recorder = RunRecorder(ctx.bus, self.run_dir)
        await self.recorder.start()
        self.task = asyncio.create_task(self.recorder.run())

    async def produce(self, ctx: Context) -> AsyncIterator[Event]:
        await asyncio.Event().wait()
        yield  # pragma: no cover - makes this an async generator

    async def teardown(self, ctx: Context) -> None:
        from dora.report import load_run, render_report

        await self.recorder.stop()
        await asyncio.gather(self.task, return_exceptions=True)
        self.report = await asyncio.to_thread(render_report, load_run(self.run_dir))
        ctx.log.info("report_written", path=str(self.report))

    def progress_done(self) -> int | None:
        recorder = getattr(self, "recorder", None)
        return None if recorder is None else sum(recorder.stats.written.values())

    def summary(self) -> dict[str, Any]:
        report = getattr(self, "report", None)
        return {"report": str(report)} if report else {}
