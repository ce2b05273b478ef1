"""scripts/setup.sh's two choices, run for real on a temporary copy of the repository's set-up files with a
stand-in python: which route (cpu or gpu) the environment is built for, and where torch comes from.

The stand-in (FAKE_PYTHON) is the system python that makes the venv and the venv's python: it records every
command line, runs ``-c`` snippets against a fake installed torch, and answers ``pip install torch==<v>``
from a table of sources (FAKE_PIP_WORLD: pip's configured sources, an index URL, a folder of wheels) the way
pip matches a version: ``torch==2.13.0`` takes any build of 2.13.0, the newest local label first (so a
source with both picks ``+cpu``); ``torch==2.13.0+cpu`` takes only the CPU build. Nothing reaches a network,
and the repository's own .venv is never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# public PyPI: its Linux torch wheel is the CUDA build, and it has no +cpu builds
PUBLIC = {"configured": ["2.13.0"], CPU_INDEX: ["2.13.0+cpu"]}
# a machine whose pip.conf adds a folder of wheels holding the CPU build (this development machine)
WHEEL_FOLDER_IN_PIP_CONF = {"configured": ["2.13.0", "2.13.0+cpu"]}

FAKE_PYTHON = r"""#!{python}
import importlib.metadata, json, os, shutil, sys
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(args) + "\n")
state = Path(sys.argv[0]).parent.parent / "fake-torch-version"
if args[:2] == ["-m", "venv"]:
    (Path(args[2]) / "bin").mkdir(parents=True)
    shutil.copy(sys.argv[0], Path(args[2]) / "bin" / "python")
elif args == ["--version"]:
    print("Python 3.11.0")
elif args[:1] == ["-c"]:
    def version(name):
        if name != "torch" or not state.exists():
            raise importlib.metadata.PackageNotFoundError(name)
        return state.read_text()
    importlib.metadata.version = version
    exec(args[1])
elif args[:2] == ["-m", "pip"] and "install" in args:
    wanted = [a.split("==", 1)[1] for a in args if a.startswith("torch==")]
    if wanted:
        world = json.loads(os.environ["FAKE_PIP_WORLD"])
        if "--index-url" in args:
            sources = [args[args.index("--index-url") + 1]]
        else:
            sources = ["configured"]
        if "--find-links" in args:
            sources.append(args[args.index("--find-links") + 1])
        found = [v for s in sources for v in world.get(s, [])]
        want = wanted[0]
        match = [v for v in found if v == want or ("+" not in want and v.split("+")[0] == want)]
        if not match:
            sys.exit(f"ERROR: No matching distribution found for torch=={want}")
        state.write_text(max(match, key=lambda v: (v.split("+")[0], "+" in v)))
"""


def stub(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """The files set-up reads and runs, copied; redis-server, promtool and helm are stand-ins that answer
    ``--version`` (so no apt-get runs), and the system python is FAKE_PYTHON."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for script in (ROOT / "scripts").glob("setup*.sh"):
        shutil.copy2(script, repo / "scripts" / script.name)
    for name in ("pyproject.toml", "constraints.txt", "Makefile"):
        shutil.copy2(ROOT / name, repo / name)
    bin_dir = tmp_path / "bin"
    stub(bin_dir / "python3.11", FAKE_PYTHON.replace("{python}", sys.executable))
    stub(bin_dir / "redis-server", "#!/bin/sh\necho 'Redis server v=7.0.15'\n")
    stub(bin_dir / "promtool", "#!/bin/sh\nexit 0\n")
    stub(repo / ".tools" / "bin" / "helm", "#!/bin/sh\necho v3.19.0\n")
    return repo


def run(
    repo: Path, command: list[str], world: dict[str, list[str]], **env: str
) -> tuple[subprocess.CompletedProcess[str], list[list[str]]]:
    """``command`` in ``repo`` with only ``env``'s VCPO_* variables set; (the result, every python command
    line it ran, the venv's and the system one's)."""
    log = repo.parent / "python-calls.jsonl"
    log.unlink(missing_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VCPO_", "PIP_", "MAKE"))}
    base |= {
        "PATH": f"{repo.parent / 'bin'}:{os.environ['PATH']}",
        "PYTHON": "python3.11",
        "FAKE_LOG": str(log),
        "FAKE_PIP_WORLD": json.dumps(world),
    }
    done = subprocess.run(
        command, cwd=repo, env=base | env, capture_output=True, text=True, timeout=60, check=False
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return done, calls


def torch_installs(calls: list[list[str]]) -> list[list[str]]:
    """The pip install command lines that ask for torch (what follows ``-m pip``)."""
    return [
        c[2:]
        for c in calls
        if c[:2] == ["-m", "pip"] and "install" in c and any(a.startswith("torch==") for a in c)
    ]


def installed(repo: Path) -> str:
    return (repo / ".venv" / "fake-torch-version").read_text()


def test_the_cpu_route_never_asks_for_a_build_that_could_be_the_cuda_one(repo: Path) -> None:
    """Public PyPI only: the exact +cpu build is asked of pip's sources, then of PyTorch's CPU index."""
    done, calls = run(repo, ["scripts/setup.sh"], PUBLIC)
    assert done.returncode == 0, done.stderr
    installs = torch_installs(calls)
    assert all("torch==2.13.0+cpu" in c for c in installs), installs  # never torch==2.13.0 alone
    assert [c for c in installs if "--index-url" in c] == [installs[-1]]
    assert installs[-1][installs[-1].index("--index-url") + 1] == CPU_INDEX
    assert installed(repo) == "2.13.0+cpu"
    assert f"from {CPU_INDEX}" in done.stdout  # it says where torch comes from
    assert (repo / ".venv" / ".setup-stamp").read_text().split()[0] == "cpu"


def test_the_cpu_route_takes_the_cpu_build_from_pips_own_sources_first(repo: Path) -> None:
    """A pip.conf that already offers the CPU build (a mirror, a wheel folder; offline machines): one install
    from there, and PyTorch's index is never dialled."""
    done, calls = run(repo, ["scripts/setup.sh"], WHEEL_FOLDER_IN_PIP_CONF)
    assert done.returncode == 0, done.stderr
    assert torch_installs(calls) == [
        ["--disable-pip-version-check", "install", "--quiet", "torch==2.13.0+cpu"]
    ]
    assert "pip's configured sources" in done.stdout
    assert installed(repo) == "2.13.0+cpu"


@pytest.mark.parametrize("kind", ["url", "folder"])
def test_vcpo_torch_index_names_the_one_source_of_torch(repo: Path, tmp_path: Path, kind: str) -> None:
    """VCPO_TORCH_INDEX: a URL is an index (--index-url), a folder is a folder of wheels (--find-links)."""
    source = "https://mirror.example/torch-cpu" if kind == "url" else str(tmp_path / "wheels")
    (tmp_path / "wheels").mkdir()
    world = {"configured": ["2.13.0"], source: ["2.13.0+cpu"]}
    done, calls = run(repo, ["scripts/setup.sh"], world, VCPO_TORCH_INDEX=source)
    assert done.returncode == 0, done.stderr
    flag = "--index-url" if kind == "url" else "--find-links"
    [install] = torch_installs(calls)
    assert install[install.index(flag) + 1] == source and "torch==2.13.0+cpu" in install
    assert f"VCPO_TORCH_INDEX={source}" in done.stdout
    assert installed(repo) == "2.13.0+cpu"


def test_a_cpu_build_nowhere_and_a_source_that_is_neither_url_nor_folder_are_refused_clearly(
    repo: Path,
) -> None:
    done, calls = run(repo, ["scripts/setup.sh"], {"configured": ["2.13.0"]})
    assert done.returncode == 1
    assert "torch==2.13.0+cpu" in done.stderr and "VCPO_TORCH_INDEX" in done.stderr
    assert not (repo / ".venv" / "fake-torch-version").exists()
    done, calls = run(repo, ["scripts/setup.sh"], PUBLIC, VCPO_TORCH_INDEX="no/such/folder")
    assert done.returncode == 2 and "VCPO_TORCH_INDEX='no/such/folder'" in done.stderr
    assert torch_installs(calls) == []


def test_the_gpu_route_takes_the_default_build_and_refuses_a_cpu_one(repo: Path) -> None:
    done, calls = run(repo, ["scripts/setup.sh"], PUBLIC, VCPO_TARGET="gpu")
    assert done.returncode == 0, done.stderr
    assert torch_installs(calls) == [["--disable-pip-version-check", "install", "--quiet", "torch==2.13.0"]]
    assert installed(repo) == "2.13.0"
    shutil.rmtree(repo / ".venv")
    done, _ = run(repo, ["scripts/setup.sh"], WHEEL_FOLDER_IN_PIP_CONF, VCPO_TARGET="gpu")
    assert done.returncode == 1 and "the gpu route got the CPU build" in done.stderr, done.stderr
    assert "VCPO_TORCH_INDEX" in done.stderr


def test_the_torch_version_is_constraints_txts_pin(repo: Path) -> None:
    constraints = repo / "constraints.txt"
    constraints.write_text(constraints.read_text().replace("torch==2.13.0", "torch==2.14.1"))
    done, calls = run(repo, ["scripts/setup.sh"], {"configured": ["2.14.1+cpu"]})
    assert done.returncode == 0, done.stderr
    assert [c[-1] for c in torch_installs(calls)] == ["torch==2.14.1+cpu"]


def test_make_run_after_a_gpu_setup_keeps_the_gpu_environment(repo: Path) -> None:
    """``VCPO_TARGET=gpu make setup``, then ``make run`` with the variable unset: the environment remembers
    its route, so set-up has nothing to do and the launcher starts; asking for the other route is refused with
    the command that switches, and nothing is installed."""
    done, _ = run(repo, ["make", "setup"], PUBLIC, VCPO_TARGET="gpu")
    assert done.returncode == 0, done.stderr
    done, calls = run(repo, ["make", "run"], PUBLIC)
    assert done.returncode == 0, done.stderr
    assert "python environment up to date" in done.stdout and "route gpu" in done.stdout
    assert not [c for c in calls if c[:2] == ["-m", "pip"]]
    assert ["-m", "deploy.launch", "--config", "deploy/presets/local.toml"] in calls
    assert installed(repo) == "2.13.0"
    done, calls = run(repo, ["make", "setup"], PUBLIC, VCPO_TARGET="cpu")
    assert done.returncode != 0
    assert "rm -rf .venv && VCPO_TARGET=cpu make setup" in done.stderr, done.stderr
    assert not [c for c in calls if c[:2] == ["-m", "pip"]]


def test_an_environment_set_up_before_the_route_was_recorded_keeps_its_route(repo: Path) -> None:
    """A venv whose only record is an older stamp (first field: the route) is rebuilt on its own route."""
    done, _ = run(repo, ["scripts/setup.sh"], PUBLIC, VCPO_TARGET="gpu")
    assert done.returncode == 0, done.stderr
    (repo / ".venv" / ".vcpo-target").unlink(missing_ok=True)
    (repo / ".venv" / ".setup-stamp").write_text("gpu 0123456789abcdef\n")
    done, calls = run(repo, ["scripts/setup.sh"], PUBLIC)
    assert done.returncode == 0, done.stderr
    assert [c[-1] for c in torch_installs(calls)] == ["torch==2.13.0"]
    assert (repo / ".venv" / ".setup-stamp").read_text().split()[0] == "gpu"
