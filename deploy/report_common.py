"""Small helpers the run report's modules share (deploy/report*.py): a module of its own because
``python -m deploy.report`` runs report.py as ``__main__``, so the others cannot import it."""

from __future__ import annotations

import math
from typing import Any


def finite(value: Any) -> float | None:
    """The value as a float if it is a finite number (not a bool, None, NaN or a string), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def fmt(value: Any, spec: str = ".4f") -> str:
    """A figure for report.md: ``spec``-formatted, or "n/a" when there is none."""
    return "n/a" if value is None else format(value, spec)


def table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> list[str]:
    """A markdown table's lines."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
