"""Processes of this machine by PID: whether one still runs, and sweeping what dead ones left behind in a
directory (files or directories named after their owner's PID)."""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine still runs (another user's process counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_dead(directory: Path, pattern: str, what: str, include_own: bool = False) -> int:
    """Remove the entries of ``directory`` whose names match ``pattern`` (a regular expression whose first
    group is the owner's PID) and whose owner is gone; returns how many. With ``include_own``, this process's
    own entries go too: a container's process restarts under the PID it had, so at start-up an entry with
    its PID is a previous life's."""
    removed = 0
    try:
        entries = list(directory.iterdir())
    except OSError:
        return 0
    for path in entries:
        match = re.fullmatch(pattern, path.name)
        if not match:
            continue
        pid = int(match.group(1))
        if (pid == os.getpid() and not include_own) or (pid != os.getpid() and pid_alive(pid)):
            continue
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed += 1
        except OSError:
            continue
    if removed:
        log.info("removed %d %s of dead processes from %s", removed, what, directory)
    return removed
