"""Layout checks that `make lint` runs beside ruff, mypy and the import contract (lint-imports).

Files stay under 500 lines: a longer file is usually two or three responsibilities that a reader
has to tell apart. Tests are exempt, since a test file grows with the cases of one module. Prints each
offender with its length and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

MAX_LINES = 500
EXEMPT = ("tests/",)  # a test module grows with the cases of the module it tests


def tracked_python_files(root: Path) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [root / line for line in out.splitlines() if line and not line.startswith(EXEMPT)]


def too_long(files: list[Path], max_lines: int) -> list[tuple[Path, int]]:
    lengths = ((path, len(path.read_text(encoding="utf-8").splitlines())) for path in files if path.is_file())
    return [(path, n) for path, n in lengths if n > max_lines]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-lines", type=int, default=MAX_LINES)
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    offenders = too_long(tracked_python_files(root), args.max_lines)
    for path, n in sorted(offenders, key=lambda item: -item[1]):
        print(f"{path.relative_to(root)}: {n} lines (at most {args.max_lines} outside tests/; split it)")
    return 1 if offenders else 0


if __name__ == "__main__":
    sys.exit(main())
