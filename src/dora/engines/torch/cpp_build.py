"""Build-once loading of the engine's inline C++ extensions (paged attention, row ops).

Both are compiled with ``-march=native`` on first use and cached by torch under
``~/.cache/torch_extensions``; the build name carries a hash of the CPU's features and of the
source, so a cached build is never loaded on a CPU that lacks its instructions, nor for
another source, and a cached build is loaded directly (without torch's build lock). Without
a compiler (or with the extension's environment switch set to ``0``) the caller gets None and
uses its torch path.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import structlog

from dora.logs import notice

log = structlog.get_logger(__name__)

T = TypeVar("T")

_lock = threading.Lock()
_built: dict[str, object] = {}


def cpu_tag() -> str:
    """Short hash of the CPU's features (part of every build name)."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags += platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def load_extension(name: str, source: str, switch: str, bind: Callable[[], T]) -> T | None:
    """``bind()`` after compiling ``source`` as ``name`` (once per process), or None when
    ``$switch`` is ``0`` or the build fails (logged, never raised)."""
    with _lock:
        if name not in _built:
            _built[name] = _compile(name, source, switch, bind)
        return _built[name]  # type: ignore[return-value]


def build_name(name: str, source: str) -> str:
    """The name says which CPU and which source: a build of that name is the right one."""
    return f"{name}_{cpu_tag()}_{hashlib.sha256(source.encode()).hexdigest()[:8]}"


def _compile(name: str, source: str, switch: str, bind: Callable[[], T]) -> T | None:
    if os.environ.get(switch, "1") == "0":
        log.info("extension_disabled", extension=name, reason=f"{switch}=0")
        return None
    try:
        import torch
        from torch.utils.cpp_extension import _get_build_directory, load_inline

        full = build_name(name, source)
        built = Path(_get_build_directory(full, verbose=False))
        library = built / f"{full}.so"
        if library.is_file():
            # load it without torch's build lock: a process killed while holding that lock
            # (a SIGKILLed engine starting up) leaves it behind, and every later
            # ``load_inline`` of the extension would wait on it forever
            torch.ops.load_library(str(library))
            return bind()
        notice(f"building the C++ kernel {name} (first run on this machine, about a minute)")
        _drop_stale_lock(built)
        load_inline(
            name=full,
            cpp_sources=[source],
            extra_cflags=["-O3", "-march=native"],
            is_python_module=False,
            verbose=False,
        )
        return bind()
    except Exception as exc:  # no compiler, no ninja, unsupported platform: use torch
        log.warning("extension_unavailable", extension=name, error=f"{exc!r}"[:300])
        return None


STALE_LOCK_S = 600.0
"""A build lock older than this was left by a killed build (a build takes about a minute)."""


def _drop_stale_lock(built: Path) -> None:
    lock = built / "lock"
    with contextlib.suppress(OSError):
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            log.warning("extension_stale_lock_removed", path=str(lock))
