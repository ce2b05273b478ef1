"""The bootstrap of a sandboxed run: it closes every door it can, then runs the response as ``__main__``.

``sandbox.run_python`` starts it by path as ``python -I -S -B -X utf8 _sandbox_child.py SCRATCH REPORT_FD CPU
MEMORY FILE_BYTES OPEN_FILES UID GID`` in a new session, with an almost empty environment and the scratch directory
as its working directory. In order, before any response code runs:

1. it reads the response from ``SCRATCH/response.py`` and deletes the file;
2. it enters new namespaces: network (only a loopback that is down: nothing to connect to, not even the host) and
   mount (a private tmpfs of at most ``FILE_BYTES`` over the scratch directory, every other mount read-only). As
   root it does this directly; otherwise inside a new user namespace, whose capabilities it then drops. Where the
   kernel refuses both, the guard below is the only network and file barrier, and says so in the layers line;
3. it sets rlimits: CPU seconds, address space, file size, open files, no core dumps, and processes when the
   service is not root (a dropped uid's count is shared by every sandbox on the host, so not there);
4. when root and given a uid, it drops to it (groups, gid, uid), so the kernel refuses what that user may not do
   (e.g. read ``/proc/<service pid>/environ``). The interpreter may live where that user cannot go (e.g. under
   ``/root``), so the library directories are opened first and imports go through ``/proc/self/fd/N``;
5. it installs the guard (``sys.addaudithook``, which cannot be removed): see :func:`make_guard`; deletes the
   few functions that create files or signal processes without an audit event (``os.mkfifo``, ``os.mknod``,
   ``os.pidfd_open``); and turns bytecode caches off, so that imports compile from source and ``marshal``
   (bytecode nobody checked) can be refused to the code.

The first line written to ``REPORT_FD`` names the layers in place (``layers network=namespace ...``); every
refusal of the guard adds a ``violation EVENT: WHY`` line, so the parent reports the run as a violation even when
the code catches the ``PermissionError``. A failure of the set-up itself is a ``setup_failed`` line and exit
status :data:`EXIT_SETUP_FAILED`: that is the sandbox's fault, not the response's.
"""

import os
import sys

CODE_FILE = "response.py"
EXIT_SETUP_FAILED = 125
EXIT_GUARD_SILENCED = 126  # the report descriptor was closed or replaced: stop rather than refuse unseen
MAX_CREATES = 1024  # files and directories one run may create (bounds a scratch directory without a tmpfs)
NPROC_LIMIT = 32  # tasks (threads included) of the sandbox's uid, when it is not root

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC = 1024, 2048, 4096, 16384
_MS_PRIVATE, _MS_RELATIME = 1 << 18, 1 << 21
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
# statvfs flags a read-only bind remount must keep (a user namespace may not clear locked ones)
_KEPT_FLAGS = ((2, _MS_NOSUID), (4, _MS_NODEV), (8, _MS_NOEXEC), (1024, _MS_NOATIME), (2048, _MS_NODIRATIME))
_ST_RELATIME = 4096

# Modules whose import is refused: native memory access, process creation, sub-interpreters (which do not
# inherit the guard), files written by C code without an audit event, and CPython's test hooks. posix and
# _signal are always loaded: importing them again would bring back the functions deleted before the code runs.
REFUSED_MODULES = frozenset(
    {
        "ctypes",
        "_ctypes",
        "_ctypes_test",
        "_posixsubprocess",
        "multiprocessing",
        "_multiprocessing",
        "_posixshmem",
        "_xxsubinterpreters",
        "_xxinterpchannels",
        "_testcapi",
        "_testinternalcapi",
        "_testbuffer",
        "_testmultiphase",
        "_testimportmultiple",
        "_testclinic",
        "_xxtestfuzz",
        "_sqlite3",
        "sqlite3",
        "readline",
        "syslog",
        "nis",
        "_tkinter",
        "posix",
        "_signal",
    }
)
# Events refused whatever their arguments.
REFUSED_EVENTS = frozenset(
    {
        "os.system",
        "os.exec",
        "os.fork",
        "os.forkpty",
        "os.posix_spawn",
        "os.spawn",
        "os.startfile",
        "subprocess.Popen",
        "pty.spawn",
        "os.symlink",
        "os.link",
        "os.chown",
        "sys.settrace",
        "sys.setprofile",
        "cpython.PyInterpreterState_New",
        "code.__new__",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "resource.prlimit",
        "webbrowser.open",
        "marshal.load",
        "marshal.loads",
    }
)
REFUSED_PREFIXES = ("socket.", "ctypes.", "sqlite3.", "syslog.", "_posixsubprocess.")


def make_guard(scratch: str, pid: int, report_fd: int):
    """The audit hook that refuses what the kernel layers may not cover.

    Refused: starting processes; sockets; ctypes; the modules in :data:`REFUSED_MODULES`; symlinks, hard links
    and chown; writing, creating, renaming, removing, chmod-ing or touching anything outside the scratch
    directory (``/dev/null`` and the process's own pipes excepted); reading or listing anything under ``/proc``
    but the process's own entry; a descriptor for a directory outside the scratch directory (a base for paths
    the guard could not resolve); changing directory out of the scratch directory; ``..`` in a relative path
    given to ``os.open`` (its ``dir_fd`` is not in the event); signals to other processes; tracing hooks,
    sub-interpreters, new code objects, marshal and heap walks (ways to reach or rewrite the guard, or to run
    bytecode that ``compile`` did not make).

    Paths are judged after resolving symlinks (``/proc/self/fd/N`` included) with primitives bound here, not
    looked up later: the code it guards shares ``os``, ``builtins`` and every module with it, and could replace
    them. For the same reason the guard is one function, without helpers, whose closure holds only immutable
    values and builtin functions: a frame of it (reachable from a refusal's traceback) shows those values and
    nothing to rewrite. Names and paths given as ``str`` subclasses are judged by their plain value (what the C
    code that raised the event uses), never through methods the subclass may override.
    """
    _type, _str, _bytes, _int, _len = type, str, bytes, int, len
    _Exception, _OSError, _ValueError, _TypeError = Exception, OSError, ValueError, TypeError
    _PermissionError, max_creates, exit_silenced = PermissionError, MAX_CREATES, EXIT_GUARD_SILENCED
    _plain_str, _plain_bytes = str.__str__, b"".join  # a str (subclass)'s value; a bytes-like's, as bytes
    _lstat, _stat, _fstat, _readlink, _getcwd = os.lstat, os.stat, os.fstat, os.readlink, os.getcwd
    _fspath, _write, _exit, _getpid = os.fspath, os.write, os._exit, os.getpid
    report_ino = os.fstat(report_fd).st_ino
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    o_creat = os.O_CREAT
    s_ifmt, s_iflnk, s_ifdir = 0o170000, 0o120000, 0o040000
    inside = scratch + "/"
    own_proc = f"/proc/{pid}"
    own_proc_dir = own_proc + "/"
    own_fds = own_proc + "/fd/"
    refused_modules, refused_events, refused_prefixes = REFUSED_MODULES, REFUSED_EVENTS, REFUSED_PREFIXES
    # event: ((path argument, its dir_fd argument or -1, kind), ...); kinds: w(rite), c(reate), r(ead),
    # d (chdir); an "o" suffix marks os.open, whose dir_fd the event does not carry
    path_events = (
        ("os.rename", ((0, 2, "w"), (1, 3, "w"))),
        ("os.remove", ((0, 1, "w"),)),
        ("os.rmdir", ((0, 1, "w"),)),
        ("os.mkdir", ((0, 2, "c"),)),
        ("os.chmod", ((0, 2, "w"),)),
        ("os.truncate", ((0, -1, "w"),)),
        ("os.utime", ((0, 3, "w"),)),
        ("os.setxattr", ((0, -1, "w"),)),
        ("os.removexattr", ((0, -1, "w"),)),
        ("os.listdir", ((0, -1, "r"),)),
        ("os.scandir", ((0, -1, "r"),)),
        ("os.chdir", ((0, -1, "d"),)),
    )
    watched = refused_events | {name for name, _ in path_events} | {"import", "open", "os.kill", "os.killpg"}
    creates = 0

    def guard(event, args):
        nonlocal creates
        if _type(event) is not _str:
            return  # only code raises events with odd names; they guard nothing
        if event not in watched and not event.startswith(refused_prefixes):
            return  # the common case, first: most events are none of ours
        why = None
        checks = []  # (path, dir_fd, kind)
        if event in refused_events or event.startswith(refused_prefixes):
            why = "not allowed in the sandbox"
        elif event == "import":
            for name in args[:2]:
                if name is None:
                    continue
                try:
                    name = _plain_str(name)
                except _TypeError:
                    why = "a module name that is not a string"
                    break
                if name.rpartition("/")[2].partition(".")[0] in refused_modules:
                    why = f"module {name!r} is not allowed"
                    break
        elif event == "open":
            path, mode, flags = args
            if _type(path) is _int:
                return  # re-wrapping a descriptor the process already holds
            kind = "r"
            if _type(flags) is _int and flags & write_flags:
                kind = "c" if flags & o_creat else "w"
            checks.append((path, None, kind + ("o" if mode is None else "")))
        elif event == "os.kill" or event == "os.killpg":
            if args[0] != 0 and args[0] != _getpid():  # 0, or its own pid: the session it leads alone
                why = f"signal to {args[0]}"
        else:
            for name, spec in path_events:
                if name == event:
                    for at, fd_at, kind in spec:
                        checks.append((args[at], args[fd_at] if 0 <= fd_at < _len(args) else None, kind))
        for path, dir_fd, kind in checks:
            if why is not None:
                break
            if path is None:
                continue  # the working directory: inside the scratch directory, see "d"
            if _type(path) is _int:
                path = f"/proc/self/fd/{path}"
            elif _type(path) is not _str and _type(path) is not _bytes:
                try:
                    path = _plain_str(path)
                except _TypeError:
                    try:
                        path = _fspath(path)
                    except _Exception:
                        why = f"a path of type {_type(path).__name__} that names no file"
                        break
            if _type(path) is not _str:
                try:
                    path = _plain_str(path) if _type(path) is not _bytes else path
                except _TypeError:
                    try:
                        path = _plain_bytes((path,))
                    except _TypeError:
                        why = f"a path of type {_type(path).__name__}"
                        break
                if _type(path) is _bytes:
                    path = path.decode("utf-8", "surrogateescape")
            if "\0" in path:
                why = "a path with a NUL byte"
                break
            if not path.startswith("/"):  # make it absolute
                if kind.endswith("o") and ".." in path.split("/"):
                    why = f"a relative path with '..' given to os.open: {path!r}"
                    break
                try:
                    if _type(dir_fd) is _int and dir_fd != -1:  # -1: not given (the working directory)
                        base = _readlink(f"/proc/self/fd/{dir_fd}")
                    else:
                        base = _getcwd()
                except _OSError:
                    why = f"a path relative to a directory that cannot be named: {path!r}"
                    break
                path = base + "/" + path
            pending = path.split("/")  # then resolve it: "..", ".", and every symlink on the way
            pending.reverse()
            parts: list[str] = []
            hops = 0
            while pending and hops <= 40:
                part = pending.pop()
                if part == "" or part == ".":
                    continue
                if part == "..":
                    if parts:
                        parts.pop()
                    continue
                parts.append(part)
                current = "/" + "/".join(parts)
                try:
                    if _lstat(current).st_mode & s_ifmt != s_iflnk:
                        continue
                    target = _readlink(current)
                except (_OSError, _ValueError):
                    continue  # does not exist (yet), or may not be looked at: judged as written
                hops += 1
                parts.pop()
                if target.startswith("/"):
                    parts = []
                more = target.split("/")
                more.reverse()
                pending.extend(more)
            real = "/" + "/".join(parts)
            if hops > 40:
                why = f"too many symlinks in {path!r}"
            elif kind[0] == "w" or kind[0] == "c":
                if not (
                    real.startswith(inside)
                    or real == "/dev/null"
                    or real.startswith(own_fds)  # its own pipes: a file's descriptor resolved to the file
                    or (real == scratch and event == "open")  # O_TMPFILE: an unnamed file in it
                ):
                    why = f"writing outside the scratch directory: {path!r}"
                elif kind[0] == "c" and real.startswith(inside):
                    try:
                        _lstat(real)
                    except (_OSError, _ValueError):
                        creates += 1  # a new name
                    if creates > max_creates:
                        why = f"more than {max_creates} files created"
            elif kind == "d":
                if real != scratch and not real.startswith(inside):
                    why = f"leaving the scratch directory: {path!r}"
            elif (real == "/proc" or real.startswith("/proc/")) and not (
                real == own_proc or real.startswith(own_proc_dir)
            ):
                why = f"reading {path!r}"
            elif kind == "ro" and real != scratch and not real.startswith(inside):
                try:
                    if _stat(real).st_mode & s_ifmt == s_ifdir:
                        why = f"a descriptor for the directory {path!r}, outside the scratch directory"
                except (_OSError, _ValueError):
                    pass
        if why is None:
            return
        message = f"{event}: {why}"
        line = ("violation " + message.replace("\n", " ")[:500] + "\n").encode("utf-8", "replace")
        try:
            if _fstat(report_fd).st_ino != report_ino:
                raise _OSError
            _write(report_fd, line)
        except _OSError:
            _exit(exit_silenced)
        raise _PermissionError(f"sandbox: {message}")

    return guard


def _fail(report_fd: int, message: str) -> None:
    try:
        os.write(report_fd, f"setup_failed {message}\n".encode())
    finally:
        os._exit(EXIT_SETUP_FAILED)


def _enter_namespaces(libc, scratch: str, file_bytes: int, uid: int, gid: int) -> dict[str, str]:
    """New network and mount namespaces where the kernel allows them; the layers they give."""
    import ctypes

    layers = {"network": "audit_hook", "filesystem": "audit_hook", "scratch": "directory"}
    root = os.geteuid() == 0
    flags = _CLONE_NEWNET | _CLONE_NEWNS | (0 if root else _CLONE_NEWUSER)
    if libc.unshare(flags) != 0:
        return layers
    layers["network"] = "namespace" if root else "user_namespace"
    if not root:  # keep our own uid and gid inside the user namespace (files we create must have an owner)
        real_uid, real_gid = os.getuid(), os.getgid()
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{real_uid} {real_uid} 1"),
            ("gid_map", f"{real_gid} {real_gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as handle:
                handle.write(text)
    mount = libc.mount
    mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
    if mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return layers  # never mount anything that could propagate back to the host
    owner = f",uid={uid},gid={gid}" if root and uid >= 0 else ""
    options = f"size={max(file_bytes, 4096)},nr_inodes={MAX_CREATES},mode=0700{owner}".encode()
    scratch_b = scratch.encode()
    if mount(b"tmpfs", scratch_b, b"tmpfs", _MS_NOSUID | _MS_NODEV, options) == 0:
        layers["scratch"] = "tmpfs"
    with open("/proc/self/mountinfo", "rb") as handle:
        points = [line.split(b" ")[4] for line in handle.read().splitlines()]
    read_only = True
    for point in points:
        point = point.replace(b"\\040", b" ").replace(b"\\011", b"\t").replace(b"\\012", b"\n")
        point = point.replace(b"\\134", b"\\")
        if point == scratch_b:
            continue
        try:
            kept = os.statvfs(point).f_flag
        except OSError:
            continue
        remount = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
        for st_flag, ms_flag in _KEPT_FLAGS:
            if kept & st_flag:
                remount |= ms_flag
        if kept & _ST_RELATIME:
            remount |= _MS_RELATIME
        if mount(None, point, None, remount, None) != 0 and point == b"/":
            read_only = False
    if read_only:
        layers["filesystem"] = "read_only"
    return layers


def _keep_library(entries: list[str]) -> None:
    """Import through descriptors opened now: the uid we drop to may not be able to walk to the library."""
    moved = {}
    for entry in entries:
        try:
            moved[entry] = f"/proc/self/fd/{os.open(entry, os.O_RDONLY | os.O_DIRECTORY)}"
        except OSError:
            continue

    def move(path: str) -> str:
        for entry in sorted(moved, key=len, reverse=True):
            if path == entry or path.startswith(entry + "/"):
                return moved[entry] + path[len(entry) :]
        return path

    entries[:] = list(moved.values())
    for module in list(sys.modules.values()):  # packages already imported (encodings) search their own path
        path = getattr(module, "__path__", None)
        if type(path) is list:
            path[:] = [move(item) for item in path]
    sys.path_importer_cache.clear()


def _drop_capabilities(libc) -> None:
    """Clear every capability the new user namespace gave (the code may not remount or re-map anything)."""
    import ctypes

    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def _close_doors(scratch: str, limits: list[int], uid: int, gid: int) -> dict[str, str]:
    """Steps 2 to 4 of the module docstring; the layers now in place."""
    import ctypes
    import resource

    cpu_seconds, memory_bytes, file_bytes, open_files = limits
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    layers = _enter_namespaces(libc, scratch, file_bytes, uid, gid)
    os.chdir(scratch)  # the tmpfs, not the directory it now covers
    root = os.geteuid() == 0
    drop = root and uid >= 0
    if drop:
        _keep_library(sys.path)
        for fd in (0, 1, 2):  # so that /dev/stdout & co. can still be opened by the new uid
            os.fchown(fd, uid, gid)
        if layers["scratch"] != "tmpfs":
            os.chown(scratch, uid, gid)
    for limit, value in (
        (resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1)),  # SIGXCPU first, SIGKILL a second later
        (resource.RLIMIT_AS, (memory_bytes, memory_bytes)),
        (resource.RLIMIT_FSIZE, (file_bytes, file_bytes)),
        (resource.RLIMIT_NOFILE, (open_files, open_files)),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(limit, value)
    if drop:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        if os.getuid() != uid or os.geteuid() != uid:
            raise OSError(f"still uid {os.geteuid()} after setuid({uid})")
    elif not root and layers["network"] == "user_namespace":
        _drop_capabilities(libc)
    if not root:  # not for a dropped uid: its count is shared by every sandbox on the host
        resource.setrlimit(resource.RLIMIT_NPROC, (NPROC_LIMIT, NPROC_LIMIT))
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    libc.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)  # the service's worker died: so do we
    if os.getppid() != parent:
        raise OSError("the service died while the sandbox was being set up")
    layers["user"] = "dropped" if drop else ("root" if root else "unchanged")
    layers["limits"] = "rlimit"
    layers["guard"] = "audit_hook"
    return layers


def _disarm() -> None:
    """Take away what the guard cannot see; ctypes is neutered by the guard and leaves the import cache."""
    for name in ("ctypes", "_ctypes", "ctypes._endian"):
        sys.modules.pop(name, None)
    unaudited = ("mkfifo", "mknod", "pidfd_open")  # create files or signal processes without an audit event
    for module in (os, sys.modules["posix"]):
        for name in unaudited:
            if hasattr(module, name):
                delattr(module, name)
    if hasattr(sys.modules["_signal"], "pidfd_send_signal"):
        delattr(sys.modules["_signal"], "pidfd_send_signal")
    sys.implementation.cache_tag = None  # type: ignore[assignment]  # no pyc: marshal is refused


def main() -> None:
    scratch, report_fd = sys.argv[1], int(sys.argv[2])
    limits = [int(value) for value in sys.argv[3:7]]
    uid, gid = int(sys.argv[7]), int(sys.argv[8])
    try:
        with open(os.path.join(scratch, CODE_FILE), encoding="utf-8") as handle:
            code = handle.read()
        os.remove(os.path.join(scratch, CODE_FILE))
        layers = _close_doors(scratch, limits, uid, gid)
    except Exception as exc:
        _fail(report_fd, f"{type(exc).__name__}: {exc}")
    os.write(report_fd, ("layers " + " ".join(f"{k}={v}" for k, v in layers.items()) + "\n").encode())
    _disarm()
    syntax_error = None
    try:  # under the limits, so that a pathological source cannot exhaust the machine while compiling
        source = compile(code, "<response>", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        syntax_error = exc
    sys.addaudithook(make_guard(os.getcwd(), os.getpid(), report_fd))
    sys.argv = ["<response>"]
    main_module = type(sys)("__main__")
    sys.modules["__main__"] = main_module
    if syntax_error is not None:
        raise syntax_error
    exec(source, main_module.__dict__)


if __name__ == "__main__":
    main()
