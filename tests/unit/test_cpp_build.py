"""A C++ kernel build that was killed midway (a SIGKILLed engine starting up) leaves torch's
build lock behind; the next engine must still start, not wait on it forever."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dora.engines.torch import cpu_ops
from dora.engines.torch.cpp_build import build_name


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_load() -> None:
    if cpu_ops.load() is None:  # builds it here if this machine has not yet
        pytest.skip("no C++ compiler: the engine uses its torch path")
    from torch.utils.cpp_extension import _get_build_directory

    name = build_name("dora_cpu_ops_v2", cpu_ops._SOURCE)
    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    lock.touch()  # what a process killed while holding torch's FileBaton leaves
    try:
        code = "from dora.engines.torch import cpu_ops; assert cpu_ops.load() is not None"
        done = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
    finally:
        lock.unlink(missing_ok=True)
