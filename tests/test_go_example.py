"""examples/go: the skeleton environment in Go is generated from protos/, compiles, and plays by the protocol.

Its own `go generate` runs protoc with protoc-gen-go and protoc-gen-go-grpc over protos/ (so the files'
go_package is what the generators accept), `go build` compiles it, and the server is checked from Python
through the sampler's client (tests/skeleton_env_check.py: the game, health, a bearer token, TLS). Skipped,
naming what is missing, without go, protoc and the two plugins (`make setup` installs none of them).

Where Debian's packaged Go libraries are installed (golang-google-grpc-dev, golang-google-protobuf-dev under
/usr/share/gocode) it builds against them in GOPATH mode, needing no module proxy; otherwise in module mode,
`go mod tidy` fetching the modules (skipped when it cannot).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from tests.skeleton_env_check import check_skeleton, serving
from tests.test_tls import _certificates

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "go"
GOCODE = Path("/usr/share/gocode")
TOOLS = ("go", "protoc", "protoc-gen-go", "protoc-gen-go-grpc")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(shutil.which(t) is None for t in TOOLS),
        reason=f"needs {', '.join(t for t in TOOLS if shutil.which(t) is None)} on PATH "
        "(docs/environments/go.md says how to install them)",
    ),
]


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/go built in a copy laid out as the repository is (protos/ beside examples/)."""
    tmp = tmp_path_factory.mktemp("go")
    env = dict(os.environ)
    gopath_mode = (GOCODE / "src" / "google.golang.org" / "grpc" / "health").is_dir()
    if gopath_mode:
        if (GOCODE / "src" / "github.com" / "golang" / "protobuf" / "proto" / "table_unmarshal.go").exists():
            pytest.skip(
                "Debian's golang-github-golang-protobuf-1-3-dev is installed: grpc would marshal the generated "
                "messages with protobuf's v1.3 API and fail; install golang-github-golang-protobuf-1-5-dev"
            )
        repo = tmp / "gopath" / "src" / "github.com" / "vcpo-rl" / "vcpo-rl"
        env |= {"GO111MODULE": "off", "GOPATH": f"{tmp / 'gopath'}:{GOCODE}", "GOFLAGS": ""}
    else:
        repo = tmp / "repo"
    source = repo / "examples" / "go"
    source.parent.mkdir(parents=True)
    (repo / "protos").symlink_to(ROOT / "protos")
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("vcpo", "guess-env"))
    generated = _run(["go", "generate"], source, env)
    assert generated.returncode == 0, generated.stderr
    assert sorted(p.name for p in (source / "vcpo" / "v1").iterdir()) == [
        "common.pb.go",
        "common_grpc.pb.go",
        "environment.pb.go",
        "environment_grpc.pb.go",
        "rollout.pb.go",
    ]
    if not gopath_mode:
        tidy = _run(["go", "mod", "tidy"], source, env)
        if tidy.returncode != 0:
            pytest.skip(f"go mod tidy could not fetch the Go modules: {tidy.stderr.strip()[-300:]}")
    out = tmp / "guess-env"
    built = _run(["go", "build", "-o", str(out), "."], source, env)
    assert built.returncode == 0, built.stderr
    vetted = _run(["go", "vet", "."], source, env)
    assert vetted.returncode == 0, vetted.stderr
    return out


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _certificates(tmp_path_factory.mktemp("pki"))


def test_the_go_skeleton_is_gofmt_clean() -> None:
    unformatted = subprocess.run(
        ["gofmt", "-l", "."], cwd=EXAMPLE, capture_output=True, text=True, check=True
    )
    assert unformatted.stdout == ""


def test_the_go_skeleton_plays_by_the_protocol(binary: Path, tmp_path: Path, pki: dict[str, str]) -> None:
    def start(*flags: str) -> AbstractContextManager[str]:
        return serving([str(binary)], tmp_path, *flags)

    check_skeleton(start, tmp_path, pki)


def test_the_generated_code_is_not_committed() -> None:
    tracked = subprocess.run(["git", "ls-files", "examples/go"], cwd=ROOT, capture_output=True, text=True)
    assert set(tracked.stdout.split()) <= {
        "examples/go/.gitignore",
        "examples/go/go.mod",
        "examples/go/main.go",
    }
    ignored = subprocess.run(["git", "check-ignore", "-q", "examples/go/vcpo/v1/environment.pb.go"], cwd=ROOT)
    assert ignored.returncode == 0
