"""Generate the Python protobuf and gRPC code for protos/ into gen/ (`make proto`).

The generated package is ``vcpo.v1`` (mirroring ``protos/vcpo/v1/*.proto``); pyproject.toml maps the
``vcpo`` package to ``gen/vcpo`` so an editable install imports it from there. Generated code is never
committed or edited: this script rebuilds it whenever a .proto file changes (a hash stamp makes a run with
nothing changed free), and ``--force`` rebuilds it regardless.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT = ROOT / "gen"
STAMP = OUT / ".stamp"


def proto_files() -> list[Path]:
    files = sorted(PROTO_ROOT.rglob("*.proto"))
    if not files:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    return files


def fingerprint(files: list[Path]) -> str:
    import grpc_tools

    digest = hashlib.sha256(getattr(grpc_tools, "__version__", "?").encode())
    for f in files:
        digest.update(str(f.relative_to(PROTO_ROOT)).encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()


def generate(files: list[Path]) -> None:
    import grpc_tools
    from grpc_tools import protoc

    staging = OUT.with_name("gen.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={staging}",
        f"--pyi_out={staging}",
        f"--grpc_python_out={staging}",
        *(str(f.relative_to(PROTO_ROOT)) for f in files),
    ]
    if protoc.main(args) != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise SystemExit("protoc failed (see the messages above)")
    # protoc writes modules, not packages: make every generated folder importable.
    for folder in [staging, *(p for p in staging.rglob("*") if p.is_dir())]:
        if folder != staging:
            (folder / "__init__.py").touch()
    (staging / "vcpo" / "py.typed").touch()
    shutil.rmtree(OUT, ignore_errors=True)
    staging.rename(OUT)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--force", action="store_true", help="regenerate even if nothing changed")
    args = parser.parse_args()
    files = proto_files()
    want = fingerprint(files)
    if not args.force and STAMP.exists() and STAMP.read_text() == want:
        print(f"protos up to date ({len(files)} files in {OUT.relative_to(ROOT)}/)")
        return 0
    generate(files)
    STAMP.write_text(want)
    print(f"generated {len(files)} protos into {OUT.relative_to(ROOT)}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
