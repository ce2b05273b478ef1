"""services/common/pids.py: sweeping what dead processes left in a directory, by the PID in their names, and
telling whether a process named by its identity has ended."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services.common.pids import pid_alive, sweep_dead


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_pid_alive() -> None:
    assert pid_alive(os.getpid()) and pid_alive(1)
    assert not pid_alive(dead_pid())


def test_sweep_dead_removes_only_entries_of_dead_owners(tmp_path: Path) -> None:
    gone, mine, running = dead_pid(), os.getpid(), os.getppid()
    for pid in (gone, mine, running):
        (tmp_path / f"stage-{pid}").mkdir()
        (tmp_path / f"stage-{pid}" / "model.safetensors").write_bytes(b"x" * 10)
        (tmp_path / f"seg-{pid}-3").write_bytes(b"y")
    (tmp_path / f"other-{gone}").write_bytes(b"z")  # not the pattern: never touched
    assert sweep_dead(tmp_path, r"stage-(\d+)", "staging directories") == 1
    assert sweep_dead(tmp_path, r"seg-(\d+)-\d+", "segments") == 1
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(
        [f"stage-{mine}", f"stage-{running}", f"seg-{mine}-3", f"seg-{running}-3", f"other-{gone}"]
    )
    # at start-up, this process's own entries are a previous life's (a container restarts under its PID)
    assert sweep_dead(tmp_path, r"stage-(\d+)", "staging directories", include_own=True) == 1
    assert not (tmp_path / f"stage-{mine}").exists() and (tmp_path / f"stage-{running}").exists()


def test_sweep_dead_of_a_missing_directory(tmp_path: Path) -> None:
    assert sweep_dead(tmp_path / "absent", r"stage-(\d+)", "staging directories") == 0
