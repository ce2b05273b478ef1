"""The sandbox and the ``code`` scorer: ordinary programs run and are judged; hostile ones are contained.

Every hostile program is checked for what it tried (no file written, no connection seen, no secret printed, no
process left) and for how it was reported, and the sandbox must still run an ordinary program afterwards.
"""

from __future__ import annotations

import dis
import json
import os
import secrets
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services.common import _sandbox_child
from services.common.sandbox import SandboxLimits, SandboxResult, SandboxSetupError, isolation, run_python
from services.reward.scorers import code_tests
from services.reward.scorers.base import ScoreInput, ScorerError, get_scorer

FAST = SandboxLimits(wall_seconds=1.0, cpu_seconds=1)
REPO = Path(__file__).resolve().parents[1]


def _assert_healthy() -> None:
    result = run_python("print(6 * 7)")
    assert (result.status, result.stdout) == ("ok", "42\n"), result


def _session(sid: int) -> list[int]:
    """Pids of live processes in session ``sid`` (the sandbox leads its own session)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _reported_pid(result: SandboxResult) -> int:
    return int(result.stdout.split()[0])


# -- ordinary programs -------------------------------------------------------------------------------------------


def test_runs_a_program_with_stdin_and_returns_its_output() -> None:
    result = run_python("import sys, collections\nprint(sum(map(int, sys.stdin.read().split())))", "1 2\n3\n")
    assert result.status == "ok" and result.exit_code == 0
    assert result.stdout == "6\n" and result.stderr == ""
    assert 0 < result.wall_seconds < 5


def test_an_exception_is_an_error_with_its_traceback() -> None:
    result = run_python(
        "import sys\nprint('partial')\nsys.stderr.write('warned\\n')\nraise ValueError('boom')"
    )
    assert result.status == "error" and result.exit_code == 1
    assert result.stdout == "partial\n"
    assert "warned" in result.stderr and "ValueError: boom" in result.stderr
    assert "ValueError: boom" in result.detail
    assert run_python("def broken(:\n    pass").status == "error"


def test_files_in_the_scratch_directory_and_threads_work_and_the_directory_is_removed() -> None:
    code = """
        import os, tempfile, threading, pathlib
        print(os.getcwd(), flush=True)
        os.mkdir("sub")
        with open("sub/a.txt", "w") as handle:
            handle.write("hello")
        pathlib.Path("b.txt").write_text(open("sub/a.txt").read() + "!")
        os.rename("b.txt", "sub/c.txt")
        with tempfile.NamedTemporaryFile(mode="w") as handle:
            handle.write("x")
        seen = []
        thread = threading.Thread(target=lambda: seen.append(open("sub/c.txt").read()))
        thread.start()
        thread.join()
        os.chmod("sub", 0)  # the parent removes it anyway
        print(seen[0])
    """
    result = run_python(textwrap.dedent(code))
    assert result.status == "ok", result
    scratch, text = result.stdout.split()
    assert text == "hello!"
    assert not os.path.exists(scratch)


def test_the_scratch_directory_goes_even_when_the_run_is_killed() -> None:
    result = run_python(
        "import os, time\nopen('left', 'w').write('x')\nprint(os.getcwd(), flush=True)\ntime.sleep(60)",
        limits=FAST,
    )
    assert result.status == "timeout"
    assert not os.path.exists(result.stdout.split()[0])


def test_runs_in_parallel_do_not_mix() -> None:
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: run_python(f"print(input() * {i})", "ab"), range(16)))
    assert [r.stdout for r in results] == [f"{'ab' * i}\n" for i in range(16)]


def test_a_missing_interpreter_is_a_setup_error_not_a_verdict() -> None:
    with pytest.raises(SandboxSetupError, match="/nonexistent/python"):
        run_python("print(1)", limits=SandboxLimits(python="/nonexistent/python"))


def test_isolation_names_every_layer() -> None:
    layers = isolation()
    assert layers["network"] in {"namespace", "user_namespace", "audit_hook"}
    assert layers["filesystem"] in {"read_only", "audit_hook"}
    assert layers["guard"] == "audit_hook" and layers["limits"] == "rlimit"
    if os.geteuid() == 0:
        assert layers["user"] == "nobody"


# -- hostile programs ----------------------------------------------------------------------------------------------


def test_an_endless_loop_times_out_near_the_wall_clock_limit() -> None:
    started = time.monotonic()
    result = run_python("while True:\n    pass", limits=SandboxLimits(wall_seconds=1.0, cpu_seconds=5))
    elapsed = time.monotonic() - started
    assert result.status == "timeout", result
    assert 1.0 <= result.wall_seconds < 1.5 and elapsed < 2.0
    assert run_python("import time\ntime.sleep(60)", limits=FAST).status == "timeout"
    _assert_healthy()


def test_cpu_time_is_limited() -> None:
    result = run_python("while True:\n    pass", limits=SandboxLimits(wall_seconds=10.0, cpu_seconds=1))
    assert result.status == "cpu_limit", result


@pytest.mark.parametrize(
    "attack",
    [
        "while True:\n    os.fork()",
        "while True:\n    try:\n        os.fork()\n    except PermissionError:\n        pass",
        "os.system('sleep 60 &')",
        "import subprocess\nsubprocess.Popen(['sleep', '60'])",
        "os.posix_spawn('/bin/sleep', ['sleep', '60'], {})",
        "os.execv('/bin/sleep', ['sleep', '60'])",
    ],
    ids=["fork", "fork_caught", "system", "popen", "posix_spawn", "exec"],
)
def test_process_creation_is_refused_and_nothing_survives(attack: str) -> None:
    result = run_python(f"import os\nprint(os.getpid(), flush=True)\n{attack}", limits=FAST)
    assert result.status == "violation", result
    assert _session(_reported_pid(result)) == []
    _assert_healthy()


@pytest.mark.parametrize(
    "attack",
    ["x = bytearray(10**10)", "x = []\nwhile True:\n    x.append(' ' * 10**6)"],
    ids=["bytearray", "growing_list"],
)
def test_memory_is_limited(attack: str) -> None:
    result = run_python(attack, limits=SandboxLimits(memory_bytes=256 << 20))
    assert result.status == "memory_limit", result
    _assert_healthy()


def test_no_connection_reaches_a_local_server_or_the_outside() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        port = server.getsockname()[1]
        attempts = [
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')",
            f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))",
            "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)",
            "import urllib.request\nurllib.request.urlopen('http://example.com', timeout=2)",
        ]
        for attack in attempts:
            result = run_python(attack + "\nprint('connected')", limits=FAST)
            assert result.status == "violation", result
            assert "connected" not in result.stdout
        with pytest.raises(BlockingIOError):
            server.accept()
    _assert_healthy()


def test_nothing_is_written_outside_the_scratch_directory(tmp_path: Path) -> None:
    owned = tmp_path / "escaped.txt"
    shared = Path(f"/tmp/vcpo-escape-{uuid.uuid4().hex}")
    code = f"""
        import os, pathlib, shutil
        tries = [
            lambda: open({str(owned)!r}, "w").write("x"),
            lambda: open({str(shared)!r}, "a").write("x"),
            lambda: os.open({str(shared)!r}, os.O_CREAT | os.O_WRONLY),
            lambda: pathlib.Path({str(shared)!r}).write_text("x"),
            lambda: (open("mine", "w").write("x"), os.rename("mine", {str(shared)!r})),
            lambda: shutil.copy("/etc/hostname", {str(shared)!r}),
            lambda: open("/proc/self/cwd/../{shared.name}", "w").write("x"),
            lambda: (os.chdir("/tmp"), open({shared.name!r}, "w").write("x")),
            lambda: os.write(os.open({shared.name!r}, os.O_CREAT | os.O_WRONLY, dir_fd=os.open("/tmp", 0)), b"x"),
            lambda: (os.symlink("/tmp", "link"), open("link/{shared.name}", "w").write("x")),
        ]
        for attempt in tries:
            try:
                attempt()
                print("written")
            except Exception as exc:
                print("refused", type(exc).__name__)
    """
    result = run_python(textwrap.dedent(code), limits=FAST)
    assert result.status == "violation", result
    assert "written" not in result.stdout and result.stdout.count("refused") == 10
    assert not owned.exists() and not shared.exists()
    _assert_healthy()


def test_the_services_secrets_are_not_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    token = secrets.token_hex(16)
    monkeypatch.setenv("VCPO_SANDBOX_SECRET", token)
    probe = """
        import os
        tries = [
            lambda: repr(dict(os.environ)),
            lambda: open(f"/proc/{os.getppid()}/environ").read(),
            lambda: open("/proc/1/environ").read(),
            lambda: open("/proc/self/environ").read(),
            lambda: os.read(os.open(f"/proc/{os.getppid()}/environ", os.O_RDONLY), 1 << 20).decode("latin-1"),
            lambda: open(f"/proc/self/root/proc/{os.getppid()}/environ").read(),
            lambda: "".join(open(f"/proc/{p}/environ").read() for p in os.listdir("/proc") if p.isdigit()),
        ]
        for attempt in tries:
            try:
                print(attempt())
            except Exception as exc:
                print("refused", type(exc).__name__)
    """
    # the service: a process started with the secret in its environment (what /proc/<pid>/environ shows)
    service = f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        from services.common.sandbox import run_python
        assert os.environ["VCPO_SANDBOX_SECRET"] in open(f"/proc/{{os.getpid()}}/environ").read()
        result = run_python({textwrap.dedent(probe)!r})
        print(result.status)
        print(result.stdout)
        print(result.stderr)
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(service)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.startswith("violation"), done.stdout
    assert done.stdout.count("refused") >= 6
    assert token not in done.stdout and token not in done.stderr
    direct = run_python(textwrap.dedent(probe))
    assert token not in direct.stdout + direct.stderr
    _assert_healthy()


def test_a_flood_of_output_is_cut_at_the_limit() -> None:
    limits = SandboxLimits(output_bytes=4096, wall_seconds=5.0)
    result = run_python("while True:\n    print('x' * 1000)", limits=limits)
    assert result.status == "output_limit", result
    assert len(result.stdout) <= 4096
    _assert_healthy()


@pytest.mark.parametrize(
    ("attack", "refused"),
    [
        ("import ctypes", "ctypes"),
        ("__import__(type('S', (str,), {'partition': lambda s, *a: ('x', '', '')})('ctypes'))", "ctypes"),
        ("import _xxsubinterpreters", "_xxsubinterpreters"),
        ("f = lambda: 0\nf.__code__ = f.__code__.replace(co_consts=())", "code.__new__"),
        ("import marshal\nmarshal.loads(marshal.dumps(1))", "marshal.loads"),
        ("import gc\ngc.get_objects()", "gc.get_objects"),
        ("import sys\nsys.settrace(lambda *a: None)", "sys.settrace"),
        ("import os\nos.kill(os.getppid(), 9)", "os.kill"),
        ("import builtins, os\nbuiltins.type = lambda x: int\nos.lstat = None\nopen(TARGET, 'w')", "TARGET"),
        (
            "import os\ntry:\n    os.system('x')\nexcept PermissionError as e:\n    tb = e.__traceback__\n"
            "    while tb.tb_next:\n        tb = tb.tb_next\n    tb.tb_frame.f_locals['inside'] = '/'\n"
            "open(TARGET, 'w')",
            "os.system",
        ),
    ],
    ids=[
        "ctypes",
        "str_subclass",
        "subinterpreter",
        "code_object",
        "marshal",
        "heap",
        "trace",
        "kill",
        "patched_builtins",
        "guard_frame",
    ],
)
def test_the_guard_refuses_ways_around_it(attack: str, refused: str) -> None:
    target = f"/tmp/vcpo-escape-{uuid.uuid4().hex}"
    result = run_python(attack.replace("TARGET", repr(target)), limits=FAST)
    assert result.status == "violation", result
    assert refused.replace("TARGET", target) in result.detail
    assert not os.path.exists(target)
    _assert_healthy()


def test_the_guard_keeps_nothing_the_code_could_rewrite() -> None:
    read, write = os.pipe()
    try:
        guard = _sandbox_child.make_guard("/tmp/scratch", os.getpid(), write)
    finally:
        os.close(read)
        os.close(write)
    loads = {i.opname for i in dis.get_instructions(guard)} & {"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL"}
    assert loads == set()  # builtins and module globals are shared with the code; the guard uses neither
    assert not [c for c in guard.__code__.co_consts if hasattr(c, "co_code")]  # no helper functions
    immutable = (int, str, tuple, frozenset, type, type(len), type(str.__str__))
    assert guard.__closure__ is not None
    assert all(isinstance(cell.cell_contents, immutable) for cell in guard.__closure__)


# -- the code scorer -----------------------------------------------------------------------------------------------

ADD = "a, b = map(int, input().split())\nprint(a + b)"
IO_REFERENCE = json.dumps({"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7   \n\n"]})


@pytest.fixture
def fast_code_scorer() -> Iterator[None]:
    code_tests.configure(FAST)
    yield
    code_tests.configure(SandboxLimits())


def _score(response: str, reference: str, task_id: str = "task-1") -> tuple[float, dict[str, float]]:
    score = get_scorer("code")(ScoreInput(response=response, reference=reference, task_id=task_id))
    return score.value, dict(score.components)


def test_code_passes_and_fails_io_tests() -> None:
    fenced = f"Sum them:\n```python\n{ADD}\n```\nand a note.\n```\nnot this\n```\n```python\n{ADD}\n```"
    assert _score(fenced, IO_REFERENCE) == (1.0, {"tests_passed": 2.0, "tests_total": 2.0})
    assert _score(ADD, IO_REFERENCE)[0] == 1.0  # no fence, but it parses
    assert _score(f"```\n{ADD}\n```\nFor 1 2 it prints:\n```\n3\n```", IO_REFERENCE)[0] == 0.0  # last plain
    assert _score(f"```py\n{ADD}\n```\nFor 1 2 it prints:\n```\n3\n```", IO_REFERENCE)[0] == 1.0
    value, parts = _score(ADD.replace("a + b", "a - b"), IO_REFERENCE)
    assert (value, parts["tests_passed"]) == (0.0, 0.0)
    value, parts = _score("print(3)", IO_REFERENCE)
    assert (value, parts["tests_passed"], parts["tests_total"]) == (0.0, 1.0, 2.0)


def test_code_passes_and_fails_assert_tests() -> None:
    reference = "assert add(1, 2) == 3\nassert add(-1, 1) == 0"
    assert _score("```python\ndef add(a, b):\n    return a + b\n```", reference)[0] == 1.0
    value, parts = _score("```python\ndef add(a, b):\n    return a - b\n```", reference)
    assert (value, parts) == (0.0, {"sandbox_error": 1.0, "tests_passed": 0.0, "tests_total": 1.0})


def test_a_response_without_code_scores_zero() -> None:
    assert _score("I would add the numbers.", IO_REFERENCE) == (0.0, {"no_code": 1.0})
    assert code_tests.extract_program("```cpp\nint main() {}\n```") is None
    assert code_tests.same_output("1 \n2\t\n\n", "1\n2")
    assert not code_tests.same_output("1 2", "12")


@pytest.mark.parametrize(
    "reference",
    [
        "",
        "   ",
        '{"inputs": ["1"]}',
        '{"inputs": ["1", "2"], "outputs": ["1"]}',
        '{"inputs": [], "outputs": []}',
        '{"inputs": [1], "outputs": ["1"]}',
        "[1, 2]",
        "def (:",
    ],
)
def test_a_broken_reference_is_a_scorer_error_naming_the_task(reference: str) -> None:
    with pytest.raises(ScorerError, match="task-broken") as caught:
        _score(ADD, reference, task_id="task-broken")
    assert caught.value.reason == "bad_reference"


HOSTILE = {
    "loop": "while True:\n    pass",
    "sleep": "import time\ntime.sleep(60)",
    "fork": "import os\nwhile True:\n    os.fork()",
    "system": "import os\nos.system('echo 3')",
    "memory": "x = bytearray(10**10)",
    "connect": "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
    "write": "open('/tmp/vcpo-escape-scorer', 'w').write('x')",
    "environ": "print(open('/proc/1/environ').read())",
    "flood": "while True:\n    print('3' * 1000)",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
@pytest.mark.usefixtures("fast_code_scorer")
def test_hostile_code_scores_zero(name: str) -> None:
    program = f"```python\n{HOSTILE[name]}\nprint(3)\n```"  # the right answer, if the attack let it get there
    value, parts = _score(program, json.dumps({"inputs": [""], "outputs": ["3"]}))
    assert value == 0.0 and parts["tests_passed"] == 0.0
    assert any(key.startswith("sandbox_") for key in parts), parts
    assert not os.path.exists("/tmp/vcpo-escape-scorer")
    _assert_healthy()
