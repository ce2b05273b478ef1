"""examples/typescript: typed stubs are generated from protos/, the skeleton type-checks, and it plays by the protocol.

`npm ci` runs once per module (into examples/typescript/node_modules, ignored there), then the package's own
scripts: `npm run typecheck` (proto-loader-gen-types writes src/generated/ from protos/, `tsc --noEmit` checks
the server against it) and `npm run build`. The types are real: a message field spelled in camelCase, which
the keepCase loader would silently drop, does not compile. The built server is checked from Python through the
sampler's client (tests/skeleton_env_check.py: the game, health, a bearer token, TLS). Skipped without node and
npm only.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from tests.skeleton_env_check import check_skeleton, serving
from tests.test_tls import _certificates

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "typescript"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("node") is None or shutil.which("npm") is None, reason="needs node and npm"
    ),
]


def _npm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["npm", *args], cwd=EXAMPLE, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def node_modules() -> Path:
    """examples/typescript's dependencies, installed once from its package-lock.json."""
    done = _npm("ci", "--no-audit", "--no-fund")
    assert done.returncode == 0, done.stdout + done.stderr
    return EXAMPLE / "node_modules"


@pytest.fixture(scope="module")
def typechecked(node_modules: Path) -> Path:
    """`npm run typecheck`: the stubs generated into src/generated/, and `tsc --noEmit` content with them."""
    done = _npm("run", "typecheck")
    assert done.returncode == 0, done.stdout + done.stderr
    return EXAMPLE / "src" / "generated" / "vcpo" / "v1"


@pytest.fixture(scope="module")
def built(typechecked: Path) -> Path:
    """dist/guess_env.js, compiled by `tsc` (`npm run build` without generating the stubs again)."""
    done = subprocess.run(
        [str(EXAMPLE / "node_modules" / ".bin" / "tsc")],
        cwd=EXAMPLE,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return EXAMPLE / "dist" / "guess_env.js"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _certificates(tmp_path_factory.mktemp("pki"))


def test_the_stubs_are_generated_and_the_server_type_checks(typechecked: Path, tmp_path: Path) -> None:
    generated = typechecked
    assert {"Task.ts", "StepResponse.ts", "Environment.ts"} <= {p.name for p in generated.iterdir()}
    # the proto comments reach the types, and a camelCase field (dropped at run time by keepCase) is refused
    assert "an evaluation set's tasks carry the set's own" in (generated / "Task.ts").read_text()
    wrong = tmp_path / "wrong.ts"
    wrong.write_text(
        f"import type {{ StepRequest }} from {str(generated / 'StepRequest')!r};\n"
        "export const request: StepRequest = { sessionId: 'g/0' };\n"
    )
    tsc = EXAMPLE / "node_modules" / ".bin" / "tsc"
    refused = subprocess.run(
        [str(tsc), "--noEmit", "--strict", str(wrong)], capture_output=True, text=True, timeout=120
    )
    assert refused.returncode != 0 and "'sessionId' does not exist in type 'StepRequest'" in refused.stdout


def test_the_typescript_skeleton_plays_by_the_protocol(
    built: Path, tmp_path: Path, pki: dict[str, str]
) -> None:
    def start(*flags: str) -> AbstractContextManager[str]:
        return serving(["node", str(built)], EXAMPLE, *flags)

    check_skeleton(start, tmp_path, pki)


def test_the_package_is_licensed_and_pinned() -> None:
    package = json.loads((EXAMPLE / "package.json").read_text())
    lock = json.loads((EXAMPLE / "package-lock.json").read_text())
    assert package["license"] == "Apache-2.0"
    pinned = {**package["dependencies"], **package["devDependencies"]}
    assert {"typescript", "@grpc/grpc-js", "@grpc/proto-loader", "grpc-health-check"} <= set(pinned)
    for name, version in pinned.items():
        assert version[0].isdigit(), f"{name} {version}: pin an exact version"
        assert lock["packages"][f"node_modules/{name}"]["version"] == version
