"""The files through which ``VllmEngine`` and its KV connector hand KV blocks to each other.

vLLM runs the connector in its engine-core process (scheduler side) and in each worker
(worker side); the dora engine object lives in the generator's process. They share one
directory per engine (``/dev/shm`` where it exists, so nothing touches a disk):

- ``export/<key>.json``  front end -> scheduler: "when this request finishes (the abort that
  follows), hand me the KV of its first ``num_tokens`` tokens";
- ``accepted/<key>.json`` scheduler -> front end: whether it took the request's blocks (it
  writes this when the abort reaches it, so a barrier after the abort tells the front end
  whether a snapshot is coming);
- ``kv/<key>.bin`` + ``kv/<key>.json`` worker -> front end: the gathered blocks, raw bytes,
  and their shape (the JSON is renamed into place last: its presence means complete);
- ``import/<key>.bin`` front end -> worker: blocks to scatter into a new request's blocks.

Keys are hashes of the request id, so any request id is a safe file name.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def key(request_id: str) -> str:
    """A file-name-safe key for a request id."""
    return hashlib.sha1(request_id.encode()).hexdigest()


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write JSON atomically (temp file + rename): a reader sees all of it or nothing."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON at ``path``, or None while it is not there."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


class Exchange:
    """Paths of one engine's exchange directory (both sides construct it from the root)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        for sub in ("export", "accepted", "kv", "import"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def export_order(self, request_id: str) -> Path:
        return self.root / "export" / f"{key(request_id)}.json"

    def accepted(self, request_id: str) -> Path:
        return self.root / "accepted" / f"{key(request_id)}.json"

    def kv_data(self, request_id: str) -> Path:
        return self.root / "kv" / f"{key(request_id)}.bin"

    def kv_meta(self, request_id: str) -> Path:
        return self.root / "kv" / f"{key(request_id)}.json"

    def import_data(self, request_id: str) -> Path:
        return self.root / "import" / f"{key(request_id)}.bin"

    def clear(self, request_id: str) -> None:
        """Remove every file of a request (after an export or import completed or failed)."""
        for path in (
            self.export_order(request_id),
            self.accepted(request_id),
            self.kv_data(request_id),
            self.kv_meta(request_id),
            self.import_data(request_id),
        ):
            path.unlink(missing_ok=True)
