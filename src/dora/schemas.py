"""Export and check the JSON Schema of every wire type (``schemas/``).

The schemas are generated from the pydantic models in ``dora.events`` (and ``CONTRACT.md``
from ``dora.contract``); ``schemas/`` is committed
so services in any language can produce or consume a stream without importing dora. Files are
written with a fixed formatting (sorted keys, 2-space indent, trailing newline) so that exporting
twice gives identical bytes and ``check`` can compare text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dora.events import json_schemas

DEFAULT_DIR = Path("schemas")
FIX_HINT = "run `dora schemas export` to regenerate them"


def render(schema: dict[str, Any]) -> str:
    """The canonical text of one schema file."""
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


CONTRACT_FILE = "CONTRACT.md"


def expected_files() -> dict[str, str]:
    """File name -> canonical text, for every wire type, plus the stream contract page."""
    from dora.contract import render_markdown

    files = {name: render(schema) for name, schema in sorted(json_schemas().items())}
    files[CONTRACT_FILE] = render_markdown()
    return files


def export(directory: Path = DEFAULT_DIR) -> list[Path]:
    """Write every schema into ``directory`` and remove stale ``*.json`` files; returns written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = expected_files()
    written = []
    for name, text in files.items():
        path = directory / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
        written.append(path)
    for path in directory.glob("*.json"):
        if path.name not in files:
            path.unlink()
    return written


@dataclass
class CheckResult:
    """Differences between ``schemas/`` and the models: each list holds file names."""

    stale: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.stale or self.missing or self.extra)

    def problems(self) -> list[str]:
        """One human line per file that differs."""
        return (
            [f"stale: {n} differs from its model" for n in self.stale]
            + [f"missing: {n} has no file" for n in self.missing]
            + [f"extra: {n} matches no wire type" for n in self.extra]
        )


def check(directory: Path = DEFAULT_DIR) -> CheckResult:
    """Compare ``directory`` with what ``export`` would write."""
    directory = Path(directory)
    files = expected_files()
    result = CheckResult()
    for name, text in files.items():
        path = directory / name
        if not path.exists():
            result.missing.append(name)
        elif path.read_text(encoding="utf-8") != text:
            result.stale.append(name)
    if directory.is_dir():
        result.extra = sorted(p.name for p in directory.glob("*.json") if p.name not in files)
    return result
