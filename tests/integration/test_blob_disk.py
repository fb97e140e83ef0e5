"""Deleting weight blobs gives their disk back: a run that publishes a version per step and
keeps the newest few must not keep every version in the JetStream store."""

from __future__ import annotations

import os
from pathlib import Path

from dora.bus import NatsBus
from dora.bus.server import NatsServer
from dora.subjects import Subjects


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


async def test_deleted_blobs_free_the_store_on_disk(tmp_path: Path) -> None:
    size, kept, total = 4 * 1024 * 1024, 2, 12
    with NatsServer(tmp_path / "nats") as server:
        bus = NatsBus(Subjects("disk"), server.url)
        await bus.connect()
        try:
            data = os.urandom(size)
            for i in range(total):
                await bus.put_blob(f"weights-v{i}", data)
                if i >= kept:
                    await bus.delete_blob(f"weights-v{i - kept}")
            assert await bus.get_blob(f"weights-v{total - 1}") == data
        finally:
            await bus.close()
        on_disk = _disk_bytes(tmp_path / "nats" / "jetstream")
    # the kept versions plus block slack, far below the 12 versions ever written
    assert on_disk < (kept + 2) * size, f"{on_disk / 2**20:.0f} MiB on disk for {kept} live"
