"""Run untrusted Python (a model's response) in a throw-away process, and say how it ended.

The reward service's ``code`` scorer and the sampler's ``python`` tool environment run code here (so it lives
in common, not in either service); the code may loop, fork, allocate, print, connect, write files
or read secrets, on purpose or not. Defence in depth, each layer where the OS allows it:

    run_python(code, stdin, limits)
      │ scratch dir (mkdtemp) ← response.py
      │ Popen([python -I -S -B, _sandbox_child.py, ...], new session, empty env, cwd=scratch)
      │      └─ bootstrap: namespaces (net, mount: tmpfs scratch, rest read-only) → rlimits → drop to
      │         ``limits.user`` → audit-hook guard → exec(response)
      │ parent: feeds stdin, reads stdout/stderr/report concurrently (selectors), one wall-clock deadline,
      │         a cap on the output; then kills the whole process group and removes the scratch dir
      ▼
    SandboxResult(status, exit_code, stdout, stderr, wall_seconds, detail)

What it decides:

- ``status``: ``violation`` (the guard refused an operation, even one the code caught), else ``output_limit``
  or ``timeout`` (the parent stopped it), else ``cpu_limit`` (SIGXCPU, or SIGKILL after the CPU limit),
  ``memory_limit`` (a MemoryError, or the address-space limit), ``error`` (any other non-zero exit), ``ok``.
- Nothing the code started outlives the call: the session is killed whatever happened, and the scratch
  directory is removed (its tmpfs dies with the child's mount namespace; without one it may hold files of the
  dropped user, which the parent removes as root or as their owner).
- The sandbox sees the standard library only (``-S``), compiled from source (no bytecode caches: see the
  bootstrap); nothing of the service's environment reaches it.
- A failure to set the sandbox up is :class:`SandboxSetupError`, not a verdict on the code.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pwd
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from services.common import _sandbox_child as child

_BOOTSTRAP = str(Path(child.__file__).resolve())
_ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
}
_REPORT_KEEP = 8192  # bytes of the report pipe kept (the code can write to it too)
_CHUNK = 65536


class SandboxSetupError(RuntimeError):
    """The sandbox could not be set up (not a verdict on the code it was to run)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run; the fields and defaults of ``config.SandboxConfig``, plus the interpreter."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 << 20
    output_bytes: int = 64 << 10
    file_bytes: int = 16 << 20
    max_open_files: int = 64
    user: str = "nobody"
    python: str = sys.executable


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended; ``stdout`` and ``stderr`` hold at most ``output_bytes`` together."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    wall_seconds: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@functools.lru_cache(maxsize=8)
def _user_ids(user: str) -> tuple[int, int]:
    """uid and gid the code runs as: ``user``'s when the service is root, else (-1, -1) (unchanged)."""
    if os.geteuid() != 0 or not user:
        return -1, -1
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ValueError(f"sandbox user {user!r} does not exist on this machine") from None
    return entry.pw_uid, entry.pw_gid


def run_python(code: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as a program reading ``stdin``, under ``limits``; how it ended (the code's errors included)."""
    return _run(code, stdin, limits or SandboxLimits())[0]


def isolation(limits: SandboxLimits | None = None) -> dict[str, str]:
    """The layers in place on this machine, from one probe run (cached), for a log line at service start.

    E.g. ``{"network": "namespace", "filesystem": "read_only", "scratch": "tmpfs", "user": "nobody", ...}``;
    ``audit_hook`` where only the guard stands, ``unchanged`` where the code keeps the service's uid.
    """
    return dict(_probe(limits or SandboxLimits()))


@functools.lru_cache(maxsize=4)
def _probe(limits: SandboxLimits) -> tuple[tuple[str, str], ...]:
    result, layers = _run("", "", limits)
    if result.status != "ok":
        raise SandboxSetupError(f"the sandbox's probe run ended {result.status}: {result.detail}")
    if layers.get("user") == "dropped":
        layers["user"] = limits.user
    return tuple(layers.items())


def _run(code: str, stdin: str, limits: SandboxLimits) -> tuple[SandboxResult, dict[str, str]]:
    uid, gid = _user_ids(limits.user)
    scratch = os.path.realpath(tempfile.mkdtemp(prefix="vcpo-sandbox-"))
    report_r, report_w = os.pipe()
    proc: subprocess.Popen[bytes] | None = None
    try:
        Path(scratch, child.CODE_FILE).write_text(code, encoding="utf-8")
        argv = [
            limits.python,
            "-I",
            "-S",
            "-B",
            "-X",
            "utf8",
            _BOOTSTRAP,
            scratch,
            str(report_w),
            str(limits.cpu_seconds),
            str(limits.memory_bytes),
            str(limits.file_bytes),
            str(limits.max_open_files),
            str(uid),
            str(gid),
        ]
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=scratch,
                env={**_ENV, "TMPDIR": scratch, "HOME": scratch},
                start_new_session=True,
                pass_fds=(report_w,),
            )
        except OSError as exc:
            raise SandboxSetupError(f"cannot start the sandbox interpreter {limits.python!r}: {exc}") from exc
        os.close(report_w)
        report_w = -1
        stopped, out, err, report = _supervise(proc, stdin.encode("utf-8"), report_r, started, limits)
        _kill_session(proc)
        _, wait_status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(wait_status)
        wall = time.monotonic() - started
        cpu = usage.ru_utime + usage.ru_stime
        return _verdict(proc.returncode, stopped, out, err, report, wall, cpu, limits)
    finally:
        if proc is not None and proc.returncode is None:
            _kill_session(proc)
            proc.wait()
        for fd in (report_r, report_w):
            if fd >= 0:
                os.close(fd)
        if proc is not None:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        _remove_tree(scratch)


def _supervise(
    proc: subprocess.Popen[bytes], stdin: bytes, report_r: int, started: float, limits: SandboxLimits
) -> tuple[str, bytes, bytes, bytes]:
    """Feed stdin and collect output until the process has exited and its pipes are closed, or a limit is hit.

    Returns why the parent stopped it ("", "timeout" or "output_limit"), stdout, stderr and the report bytes.
    """
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    deadline = started + limits.wall_seconds
    stdout_fd, stderr_fd, stdin_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
    out = {stdout_fd: bytearray(), stderr_fd: bytearray(), report_r: bytearray()}
    pending = memoryview(stdin)
    exit_fd = _exit_descriptor(proc.pid)
    stopped = ""
    with selectors.DefaultSelector() as selector:
        for fd in out:
            selector.register(fd, selectors.EVENT_READ)
        if pending:
            os.set_blocking(stdin_fd, False)
            selector.register(stdin_fd, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        if exit_fd is not None:
            selector.register(exit_fd, selectors.EVENT_READ)
        pipes = len(out) + bool(pending)
        exited = False
        try:
            while pipes or not exited:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    stopped = "timeout"
                    break
                events = selector.select(remaining if exit_fd is not None else min(remaining, 0.05))
                if not exited and (
                    any(key.fd == exit_fd for key, _ in events)
                    if exit_fd is not None
                    else _has_exited(proc.pid)
                ):
                    exited = True
                    if exit_fd is not None:
                        selector.unregister(exit_fd)
                    _kill_session(proc)  # the leader is gone; anything still holding the pipes goes too
                    if not proc.stdin.closed:
                        selector.unregister(stdin_fd)
                        proc.stdin.close()
                        pipes -= 1
                for key, _ in events:
                    if key.fd == exit_fd or key.fd not in selector.get_map():
                        continue
                    if key.fd == stdin_fd:
                        try:
                            pending = pending[os.write(stdin_fd, pending[:_CHUNK]) :]
                        except BlockingIOError:
                            continue
                        except BrokenPipeError:
                            pending = pending[:0]
                        if not pending:
                            selector.unregister(stdin_fd)
                            proc.stdin.close()
                            pipes -= 1
                        continue
                    data = os.read(key.fd, _CHUNK)
                    if not data:
                        selector.unregister(key.fd)
                        pipes -= 1
                    elif key.fd == report_r:
                        out[report_r] += data[: max(0, _REPORT_KEEP - len(out[report_r]))]
                    else:
                        out[key.fd] += data
                        if len(out[stdout_fd]) + len(out[stderr_fd]) > limits.output_bytes:
                            stopped = "output_limit"
                if stopped:
                    break
        finally:
            if exit_fd is not None:
                os.close(exit_fd)
    cap = limits.output_bytes
    return stopped, bytes(out[stdout_fd][:cap]), bytes(out[stderr_fd][:cap]), bytes(out[report_r])


def _verdict(
    code: int,
    stopped: str,
    out: bytes,
    err: bytes,
    report: bytes,
    wall: float,
    cpu: float,
    limits: SandboxLimits,
) -> tuple[SandboxResult, dict[str, str]]:
    lines = report.decode("utf-8", "replace").splitlines()
    first = lines[0] if lines else ""
    if first.startswith("setup_failed ") or (code == child.EXIT_SETUP_FAILED and not first):
        raise SandboxSetupError(f"the sandbox could not be set up: {first[13:] or f'exit status {code}'}")
    layers = (
        dict(item.partition("=")[::2] for item in first[7:].split()) if first.startswith("layers ") else {}
    )
    violations = [line[10:] for line in lines[1:] if line.startswith("violation ")]
    stderr = err.decode("utf-8", "replace")
    if violations:
        more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
        status, detail = "violation", violations[0] + more
    elif code == child.EXIT_GUARD_SILENCED:
        status, detail = "violation", "the guard's report descriptor was closed or replaced"
    elif stopped == "output_limit":
        status, detail = stopped, f"more than {limits.output_bytes} bytes of output"
    elif stopped == "timeout":
        status, detail = stopped, f"still running after {limits.wall_seconds:g}s (wall clock)"
    elif code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu >= limits.cpu_seconds - 0.05):
        status, detail = "cpu_limit", f"{cpu:.2f}s of CPU (limit {limits.cpu_seconds}s)"
    elif code != 0 and _out_of_memory(stderr):
        status, detail = "memory_limit", f"out of memory (address space limit {limits.memory_bytes} bytes)"
    elif code != 0:
        last = stderr.strip().rpartition("\n")[2][:200]
        status, detail = "error", f"exit status {code}" + (f": {last}" if last else "")
    else:
        status, detail = "ok", ""
    result = SandboxResult(
        status=status,
        exit_code=code,
        stdout=out.decode("utf-8", "replace"),
        stderr=stderr,
        wall_seconds=wall,
        detail=detail,
    )
    return result, layers


def _out_of_memory(stderr: str) -> bool:
    tail = stderr[-4096:]
    return (
        any(line.startswith("MemoryError") for line in tail.splitlines()) or "Cannot allocate memory" in tail
    )


def _exit_descriptor(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits (Linux pidfd), or None: then we poll."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _has_exited(pid: int) -> bool:
    """Whether ``pid`` has exited, without reaping it (its process group id stays reserved until we do)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the run's whole process group (its leader is not reaped yet, so the id is still ours)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _remove_tree(path: str) -> None:
    """Remove the scratch directory, whatever modes the code left on what it created."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return
    except OSError:
        os.chmod(path, stat.S_IRWXU)
        for root, dirs, _ in os.walk(path):
            for name in dirs:
                os.chmod(os.path.join(root, name), stat.S_IRWXU)
        shutil.rmtree(path)
