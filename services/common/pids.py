"""Processes of this machine by PID: whether one still runs, which process a PID names (its identity, which
outlives PID reuse), and sweeping what dead ones left behind in a directory (files or directories named after
their owner's PID)."""

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


def process_identity(pid: int | None = None) -> str:
    """Which process ``pid`` (default: this one) is, for another process of this machine to tell later whether
    it has gone (:func:`process_gone`): its PID namespace, PID and start time (clock ticks after boot), as
    ``/proc`` shows them; '' where ``/proc`` does not (not Linux, or the process is already gone)."""
    pid = os.getpid() if pid is None else pid
    try:
        namespace = os.readlink(f"/proc/{pid}/ns/pid")
        _state, start = _stat(pid)
    except (OSError, ValueError, IndexError):
        return ""
    return f"{namespace} {pid} {start}"


def process_gone(identity: str) -> bool:
    """Whether the process of ``identity`` (:func:`process_identity`, taken by it or of it) has certainly ended:
    no process has its PID any more, another one does (a later start), or it is a zombie. False where that
    cannot be told from here: an empty identity, or a process in another PID namespace than this one's, whose
    PIDs name other processes here."""
    return _ended(identity) is True


def process_seen(identity: str) -> bool:
    """Whether the process of ``identity`` runs now and this process can tell when it ends
    (:func:`process_gone`): it is in this PID namespace, and its PID names it here."""
    return _ended(identity) is False


def _ended(identity: str) -> bool | None:
    """Whether the process of ``identity`` has ended; None where this process cannot tell (see
    :func:`process_gone`)."""
    try:
        namespace, pid, start = identity.rsplit(" ", 2)
        if namespace != os.readlink("/proc/self/ns/pid"):
            return None
        number, began = int(pid), int(start)
    except (OSError, ValueError):
        return None
    try:
        state, now = _stat(number)
    except FileNotFoundError:  # no /proc/<pid>, where /proc/self is
        return True
    except (OSError, ValueError, IndexError):
        return None
    return now != began or state in ("Z", "X")


def _stat(pid: int) -> tuple[str, int]:
    """A process's state and start time from ``/proc/<pid>/stat`` (fields 3 and 22; its name, field 2, is in
    parentheses and may hold spaces)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[19])


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
