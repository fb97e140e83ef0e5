"""``DORA_CRASH_AT``: a real SIGKILL at a named point, the n-th time, once per run folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dora.crashpoints import parse

SCRIPT = """
from dora.crashpoints import crash_point
for i in range(5):
    crash_point("learner.before_publish")
    print(i, flush=True)
"""


def run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_process_kills_itself_the_nth_time_once(tmp_path: Path) -> None:
    env = {"DORA_CRASH_AT": "learner.before_publish:3", "DORA_CRASH_ONCE": str(tmp_path)}
    first = run(env)
    assert first.returncode == -signal.SIGKILL and first.stdout.split() == ["0", "1"]
    assert (tmp_path / "learner.before_publish").exists()
    again = run(env)  # the restarted process: the marker lets it through
    assert again.returncode == 0 and again.stdout.split() == ["0", "1", "2", "3", "4"]


def test_unset_or_elsewhere_nothing_happens() -> None:
    assert run({"DORA_CRASH_AT": ""}).returncode == 0
    assert run({"DORA_CRASH_AT": "orchestrator.after_export"}).returncode == 0


def test_a_misspelt_point_is_refused_naming_the_known_ones() -> None:
    assert parse("learner.before_publish:2, orchestrator.after_export") == {
        "learner.before_publish": 2,
        "orchestrator.after_export": 1,
    }
    with pytest.raises(ValueError, match=r"'learner\.befor' is not a crash point; known: learner"):
        parse("learner.befor")
