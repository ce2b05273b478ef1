"""The layout checks `make lint` runs (scripts/check_layout.py): files over 500 lines outside tests/ are named."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("check_layout", ROOT / "scripts/check_layout.py")
assert spec is not None and spec.loader is not None
check_layout = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_layout)


def test_a_file_over_the_limit_is_named_and_one_at_it_is_not(tmp_path: Path) -> None:
    at, over = tmp_path / "at.py", tmp_path / "over.py"
    at.write_text("x = 1\n" * 500)
    over.write_text("x = 1\n" * 501)
    assert check_layout.too_long([at, over], 500) == [(over, 501)]


def test_the_tree_keeps_its_files_under_the_limit_and_tests_are_exempt() -> None:
    files = check_layout.tracked_python_files(ROOT)
    assert ROOT / "services/learner/vcpo.py" in files
    assert not [f for f in files if f.relative_to(ROOT).parts[0] == "tests"]
    assert check_layout.too_long(files, check_layout.MAX_LINES) == []
