"""Per-source results of a calibration: how a probe's out-of-fold focus separates each source's
rows, and the ROC curves of the sources, for the report ``guardrail calibrate`` writes.

Sources are the rows' ``corpus`` (the packaged pool tags every row with one), else their task.
Focus is the probe's out-of-fold focus (each row scored by a fit that did not see its group),
so the numbers are cross-validated, not in-sample.

Example:
    >>> rows = [LabelledPair(str(i), "Q", "d", i % 2, extra={"corpus": "a"}) for i in range(4)]
    >>> table = per_source_metrics(rows, np.array([0.9, 0.2, 0.8, 0.4]), threshold=0.5)
    >>> table["a"]["auroc"], table["a"]["flagged_clean"], table["a"]["caught"]
    (1.0, 0.0, 1.0)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from guardrail.offline.datasets import LabelledPair
from guardrail.offline.evaluation import detection_metrics, markdown_table, plot_roc

__all__ = ["COLUMNS", "per_source_metrics", "plot_sources", "source_of", "sources_markdown"]

COLUMNS = ("n_clean", "n_injected", "auroc", "tpr@1%fpr", "flagged_clean", "caught")
"""The per-source table's columns (``flagged_clean`` / ``caught``: share of clean / injected
rows at or under the threshold)."""


def source_of(pair: LabelledPair) -> str:
    """The source a row is reported under: its ``corpus``, else its task."""
    return str(pair.extra.get("corpus") or pair.task)


def _at_threshold(labels: np.ndarray, focus: np.ndarray, threshold: float) -> dict[str, Any]:
    flagged = focus <= threshold
    clean, injected = labels == 0, labels == 1
    return {
        "flagged_clean": round(float(flagged[clean].mean()), 4) if clean.any() else None,
        "caught": round(float(flagged[injected].mean()), 4) if injected.any() else None,
    }


def per_source_metrics(
    pairs: Sequence[LabelledPair], focus: np.ndarray, threshold: float
) -> dict[str, dict[str, Any]]:
    """Per source (then ``all``): counts, AUROC and TPR at 1 % FPR of ``1 - focus``, and the
    shares of clean rows flagged and injected rows caught at ``threshold``.
    ``focus``: ``[rows]``, aligned with ``pairs``."""
    labels = np.array([p.label for p in pairs])
    sources = np.array([source_of(p) for p in pairs], dtype=object)
    out: dict[str, dict[str, Any]] = {}
    for name in [*sorted(set(sources.tolist())), "all"]:
        mask = np.ones(len(pairs), bool) if name == "all" else sources == name
        y, f = labels[mask], focus[mask]
        out[name] = {**detection_metrics(y, 1.0 - f), **_at_threshold(y, f, threshold)}
    return out


def sources_markdown(table: dict[str, dict[str, Any]], title: str) -> str:
    """The per-source table as markdown under a ``title`` heading."""
    return f"# {title}\n\n" + markdown_table(table, COLUMNS) + "\n"


def plot_sources(
    pairs: Sequence[LabelledPair], focus: np.ndarray, path: str | Path, title: str
) -> Path:
    """ROC curves of ``1 - focus``: all rows, then each source that has both classes."""
    labels = np.array([p.label for p in pairs])
    sources = np.array([source_of(p) for p in pairs], dtype=object)
    curves = {"all": (labels.tolist(), (1.0 - focus).tolist())}
    for name in sorted(set(sources.tolist())):
        mask = sources == name
        if len(set(labels[mask].tolist())) == 2:
            curves[name] = (labels[mask].tolist(), (1.0 - focus[mask]).tolist())
    return plot_roc(curves, path, title)
