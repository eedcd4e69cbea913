"""What the ``guardrail`` subcommands write: JSON files (numpy values included) and counts."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["count", "write_json"]


def write_json(path: Path, doc: Any) -> None:
    """Write ``doc`` as indented JSON (numpy scalars and arrays as numbers and lists),
    creating the parent directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def count(values: Iterable[Any]) -> dict[str, int]:
    """How often each value occurs, sorted by value.

    Example:
        >>> count(["b", "a", "b"])
        {'a': 1, 'b': 2}
    """
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return dict(sorted(counts.items()))
