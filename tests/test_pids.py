"""services/common/pids.py: sweeping what dead processes left in a directory, by the PID in their names, and
telling whether a process named by its identity has ended."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services.common.pids import pid_alive, process_gone, process_identity, process_seen, sweep_dead


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


def test_a_process_identity_says_when_it_ended_and_only_then() -> None:
    mine = process_identity()
    namespace, pid, start = mine.rsplit(" ", 2)
    assert namespace.startswith("pid:[") and int(pid) == os.getpid() and int(start) > 0
    assert not process_gone(mine)
    child = subprocess.Popen(["sleep", "600"])
    theirs = process_identity(child.pid)
    assert theirs.split()[1] == str(child.pid) and not process_gone(theirs)
    assert process_seen(theirs) and process_seen(mine)
    child.kill()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    assert process_gone(theirs) and not process_seen(theirs)  # a zombie: ended, not yet reaped
    child.wait()
    assert process_gone(theirs)
    assert process_identity(child.pid) == ""  # nothing to name any more
    # its PID given to a later process (the same PID, another start): the one it named has ended
    assert process_gone(f"{namespace} {pid} {int(start) - 1}")
    assert not process_seen(f"{namespace} {pid} {int(start) - 1}")


def test_what_cannot_be_told_from_here_never_counts_as_ended() -> None:
    namespace, _, start = process_identity().rsplit(" ", 2)
    gone = dead_pid()
    assert not process_gone("")
    assert not process_gone("garbage")
    assert not process_gone(f"pid:[1] {gone} {start}")  # another PID namespace: its PIDs are not ours
    assert process_gone(f"{namespace} {gone} {start}")  # ours: that PID runs nothing
    # and none of these is a process this one sees running
    mine = process_identity()
    assert process_seen(mine) and not process_seen(mine.replace("pid:[", "pid:[9"))
    assert not any(process_seen(x) for x in ("", "garbage", f"{namespace} {gone} {start}"))
