"""The container images the Helm chart points at (deploy/docker/Dockerfile.*). No Docker engine runs here, so
the files are parsed: every COPY source exists in the repository, every script a RUN names exists, the
pip extras they install are pyproject.toml's, and their pins are the project's (torch, grpcio-tools, Ray as
the chart's rayVersion)."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parent.parent
DOCKERFILES = sorted((ROOT / "deploy" / "docker").glob("Dockerfile.*"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        pending += " " + line.removesuffix("\\") if pending else line.removesuffix("\\")
        if not line.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    assert not pending, f"{path.name} ends inside a continued line"
    return out


def test_both_images_exist() -> None:
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.gpu", "Dockerfile.cpu"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    assert steps[0][0] in ("ARG", "FROM") and any(word == "FROM" for word, _ in steps)
    copies = [args for word, args in steps if word in ("COPY", "ADD")]
    assert copies
    ignored = (ROOT / ".dockerignore").read_text().split()
    for args in copies:
        parts = [p for p in shlex.split(args) if not p.startswith("--")]
        assert not args.startswith("--from"), "single-stage images: every COPY is from the build context"
        *sources, _dest = parts
        for source in sources:
            matches = list(ROOT.glob(source))
            assert matches, f"{dockerfile.name}: COPY source {source!r} does not exist in the repository"
            assert source.split("/")[0] not in ignored, f"{source} is excluded by .dockerignore"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_run_commands_name_real_scripts_extras_and_pins(dockerfile: Path) -> None:
    runs = " ".join(args for word, args in instructions(dockerfile) if word == "RUN")
    copied = " ".join(args for word, args in instructions(dockerfile) if word == "COPY")
    scripts = re.findall(r"python3?(?:\.\d+)? ((?:scripts|deploy|services|examples)/\S+\.py)", runs)
    assert scripts, "the image generates the gRPC code with scripts/gen_protos.py"
    for script in scripts:
        assert (ROOT / script).exists(), f"{dockerfile.name} runs {script}, which does not exist"
        assert script in copied or script.split("/")[0] in copied, f"{script} is run before it is copied"

    extras = re.findall(r'"\.\[([a-z,]+)\]"', runs)
    assert extras, f"{dockerfile.name} installs the project with an extra"
    known = set(PYPROJECT["project"]["optional-dependencies"])
    for group in extras:
        assert set(group.split(",")) <= known, f"{dockerfile.name}: extras {group} not in pyproject.toml"
    expected_extra = dockerfile.name.split(".")[1]  # gpu or cpu: the route of `make setup`
    assert [expected_extra] == extras

    constraints = (ROOT / "constraints.txt").read_text()
    for pin in re.findall(r'"(torch==[^"]+)"', runs):
        assert pin in constraints, f"{dockerfile.name} pins {pin}; constraints.txt does not"
    assert "-c constraints.txt" in runs
    tools = next(
        d for d in PYPROJECT["project"]["optional-dependencies"]["dev"] if d.startswith("grpcio-tools")
    )
    assert f'"{tools}"' in runs, f"{dockerfile.name} must install the same {tools} the set-up does"


def test_image_ray_is_the_charts_ray_version() -> None:
    ray = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("ray["))
    version = ray.split("==")[1]
    values = yaml.safe_load((ROOT / "helm" / "vcpo-rl" / "values.yaml").read_text())
    assert values["rayCluster"]["rayVersion"] == version, "KubeRay's rayVersion must be the image's Ray"
