"""The combined probe: attention features and hidden-state features in one sparse linear model.

Pure functions over what the serving probe measured for labelled rows: per-head attention stats
``[rows, heads, 5]``, the residual stream at the last prompt token of a few decoder layers
(``{layer: [rows, hidden_size]}``) and, optionally, the stream averaged over the data tokens
(``data_mean``, same shape; read-outs with ``position="data_mean"``) and a token-level
read-out's pooled logit (``data_top``: one column per token model, keyed by its last layer,
:class:`~guardrail.offline.token_readout.TokenColumn`). Every column is
standardised, one L1-penalised logistic regression predicts injection from all of them (the
penalty keeps few heads and few hidden coordinates), and the fit becomes a
``ModelProbeConfig``: head weights folded back to the raw feature scale (as the attention-only
logistic probe stores them), hidden coordinates kept with their standardisation
(``HiddenLayerProbe``: ``dims``, ``mean``, ``scale``, ``weights``, ``position``), so the worker
computes ``sum(weights * (x[dims] - mean) / scale)`` per layer and position.

The penalty strength is chosen by cross-validation over groups (a group's rows never straddle
folds), and thresholds are set on out-of-fold scores. :func:`worst_source_threshold` sets the
operating point on the *worst* source's clean rows, so a threshold meant to flag 1 % of clean
traffic does so on each source it was calibrated on, not only on the pooled rows.

Example:
    >>> rng = np.random.default_rng(0)
    >>> y = np.r_[np.zeros(40), np.ones(40)].astype(int)
    >>> stats = rng.uniform(0.2, 0.8, (80, 2, 5)); hidden = {3: rng.normal(0, 1, (80, 16))}
    >>> hidden[3][y == 1, 5] += 3.0  # one hidden coordinate tells injections apart
    >>> fit = fit_combined(stats, [(0, 0), (0, 1)], hidden, y, [str(i) for i in range(80)])
    >>> 5 in fit.hidden[0].dims, fit.cv_auroc > 0.9
    (True, True)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from guardrail.errors import ConfigError
from guardrail.offline.calibration import (
    OPERATING_RATES,
    group_folds,
    standardised_l1_fit,
    threshold_at_fpr,
)
from guardrail.offline.evaluation import auroc
from guardrail.offline.token_readout import TokenColumn
from guardrail.probe.config import HiddenLayerProbe, HiddenPosition
from guardrail.probe.scoring import FEATURES_PER_HEAD, FeatureKind, HeadKey, head_features

__all__ = [
    "COMBINED_C_GRID",
    "CombinedFit",
    "combined_focus",
    "feature_matrix",
    "fit_combined",
    "focus_from_logit",
    "worst_source_threshold",
    "worst_source_thresholds",
]

COMBINED_C_GRID: tuple[float, ...] = (0.003, 0.01, 0.03, 0.1, 0.3)
"""Inverse L1 strengths tried (on standardised columns; small C = few columns kept)."""


@dataclass(frozen=True)
class CombinedFit:
    """A fitted combined probe, in the form a config stores it."""

    heads: list[HeadKey]  # heads with a non-zero weight (one, weighted 0, if none has)
    weights: list[float]  # head-major, raw feature scale
    bias: float
    hidden: list[HiddenLayerProbe]  # one per (layer, position) with a non-zero coordinate
    feature: FeatureKind
    c: float
    cv_auroc: float
    oof_focus: np.ndarray  # out-of-fold focus of every row (thresholds are set on it)
    # data_top layer -> (weight, mean, std) of its pooled column in the standardised fit
    top_columns: dict[int, tuple[float, float, float]] = field(default_factory=dict)

    def probe_fields(self) -> dict[str, Any]:
        """The ``ModelProbeConfig`` fields of this probe (add model_id, threshold, sizes)."""
        return {
            "probe": "logistic",
            "heads": self.heads,
            "weights": self.weights,
            "bias": self.bias,
            "feature": self.feature,
            # no hidden coordinate kept: an attention-only config (it also runs compiled)
            "hidden": self.hidden or None,
        }


def _streams(
    hidden: Mapping[int, np.ndarray],
    data_mean: Mapping[int, np.ndarray] | None,
    data_top: Mapping[int, TokenColumn] | None = None,
) -> list[tuple[int, HiddenPosition, np.ndarray]]:
    """The hidden inputs in column order: last-token layers ascending, then data-mean ones,
    then the token read-outs' pooled columns."""
    out: list[tuple[int, HiddenPosition, np.ndarray]] = [
        (layer, "last", hidden[layer]) for layer in sorted(hidden)
    ]
    out += [(layer, "data_mean", (data_mean or {})[layer]) for layer in sorted(data_mean or {})]
    top = data_top or {}
    out += [(layer, "data_top", top[layer].values[:, None]) for layer in sorted(top)]
    return out


def feature_matrix(
    stats: np.ndarray,
    hidden: Mapping[int, np.ndarray],
    feature: FeatureKind,
    data_mean: Mapping[int, np.ndarray] | None = None,
    data_top: Mapping[int, TokenColumn] | None = None,
) -> np.ndarray:
    """Columns: the heads' features (head-major), then each hidden layer's coordinates in
    ascending layer order, then each data-mean layer's, then each token read-out's pooled
    logit. ``stats [rows, heads, 5]``, ``hidden`` and ``data_mean`` ``{layer: [rows, size]}``."""
    parts = [head_features(stats, feature)] if stats.shape[1] else []
    streams = _streams(hidden, data_mean, data_top)
    parts += [np.asarray(x, dtype=np.float64) for _, _, x in streams]
    return np.concatenate(parts, axis=1)


MAX_FIT_PROCESSES = 16
"""Processes at most for the cross-validation's fits (``_oof_logits``)."""
PARALLEL_FIT_ELEMENTS = 2_000_000
"""Fits whose matrix holds fewer elements run in this process: the pool's start and the
matrix's hand-over would cost more than they save."""


def _fold_fit(
    x: np.ndarray, y: np.ndarray, folds: np.ndarray, c: float, fold: Any
) -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
    """The fit on the rows of every fold but ``fold`` (``standardised_l1_fit``)."""
    train = folds != fold
    return standardised_l1_fit(x[train], y[train], c)


def _oof_logits(
    x: np.ndarray, y: np.ndarray, folds: np.ndarray, c_grid: Sequence[float]
) -> list[np.ndarray]:
    """The out-of-fold logit of every row for each C of ``c_grid``. The C x fold fits are
    independent; for a large ``x`` they run in a pool of processes (joblib's, which hands ``x``
    over as a memory map), one fit at a time in each. Not threads: scikit-learn's liblinear
    draws its coordinate order from one random generator per process, so fits on threads of
    one process change each other's results. The held-out logits are computed here, from each
    fit's weights, as a loop computes them (a worker's BLAS may sum in another order), so they
    are a loop's, bit for bit."""
    fold_ids = np.unique(folds).tolist()
    tasks = [(c, fold) for c in c_grid for fold in fold_ids]
    workers = 1
    if x.size >= PARALLEL_FIT_ELEMENTS:
        from joblib import cpu_count  # the cores this process may use (affinity, cgroup quota)

        workers = min(len(tasks), cpu_count(), MAX_FIT_PROCESSES)
    if workers > 1:
        from joblib import Parallel, delayed

        fits = Parallel(n_jobs=workers)(delayed(_fold_fit)(x, y, folds, *t) for t in tasks)
    else:
        fits = [_fold_fit(x, y, folds, *t) for t in tasks]
    logits = []
    at = iter(fits)
    for _ in c_grid:
        logit = np.empty(len(y))
        for fold in fold_ids:
            w, b, mean, std = next(at)
            test = folds == fold
            logit[test] = b + ((x[test] - mean) / std) @ w
        logits.append(logit)
    return logits


def focus_from_logit(logit: np.ndarray) -> np.ndarray:
    """Focus (high = trusted) from the probe's injection logit: 1 - sigmoid(logit)."""
    return 1.0 - 1.0 / (1.0 + np.exp(-np.clip(logit, -50, 50)))


def _best_c(
    x: np.ndarray, y: np.ndarray, fold_of: np.ndarray, c_grid: Sequence[float]
) -> tuple[float, float, np.ndarray]:
    """(out-of-fold AUROC, C, out-of-fold logit) of the C in ``c_grid`` with the best AUROC;
    a later C must beat an earlier one by more than 1e-4."""
    best: tuple[float, float, np.ndarray] | None = None
    for c, logit in zip(c_grid, _oof_logits(x, y, fold_of, c_grid), strict=True):
        score = auroc(y, logit)
        if best is None or score > best[0] + 1e-4:
            best = (score, c, logit)
    if best is None:
        raise ConfigError("c_grid is empty: give at least one regularisation strength C")
    return best


def _hidden_parts(
    w: np.ndarray,
    mean: np.ndarray,
    std: np.ndarray,
    offset: int,
    hidden: Mapping[int, np.ndarray],
    data_mean: Mapping[int, np.ndarray] | None,
    data_top: Mapping[int, TokenColumn] | None = None,
) -> list[HiddenLayerProbe]:
    """The hidden-state read-outs of a fit: each stream's coordinates with a non-zero weight.
    ``w``, ``mean``, ``std``: ``[features]`` of the standardised fit; the streams' columns
    start at ``offset``, in :func:`_streams`' order."""
    parts: list[HiddenLayerProbe] = []
    for layer, position, stream in _streams(hidden, data_mean, data_top):
        size = np.asarray(stream).shape[1]
        lw = w[offset : offset + size]
        dims = np.flatnonzero(np.abs(lw) > 1e-9)
        if len(dims) and position == "data_top":
            column = (data_top or {})[layer]
            parts += column.parts(float(lw[0]), float(mean[offset]), float(std[offset]))
        elif len(dims):
            parts.append(
                HiddenLayerProbe(
                    layer=int(layer),
                    dims=[int(d) for d in dims],
                    mean=[float(v) for v in mean[offset + dims]],
                    scale=[float(v) for v in std[offset + dims]],
                    weights=[float(v) for v in lw[dims]],
                    position=position,
                )
            )
        offset += size
    return parts


def fit_combined(
    stats: np.ndarray,
    heads: Sequence[HeadKey],
    hidden: Mapping[int, np.ndarray],
    labels: np.ndarray,
    groups: Sequence[str],
    feature: FeatureKind = "logit_focus",
    c_grid: Sequence[float] = COMBINED_C_GRID,
    folds: int = 5,
    seed: int = 0,
    data_mean: Mapping[int, np.ndarray] | None = None,
    data_top: Mapping[int, TokenColumn] | None = None,
) -> CombinedFit:
    """Fit the combined probe; C by grouped cross-validation (best out-of-fold AUROC). A
    token read-out (``data_top``) whose column gets a negative weight cannot be served (its
    k highest logits would be the k lowest terms): the fit is then made without it."""
    x = feature_matrix(stats, hidden, feature, data_mean, data_top)
    y = np.asarray(labels, dtype=int)
    cv_auroc, c, oof_logit = _best_c(x, y, group_folds(groups, folds, seed), c_grid)
    w, b, mean, std = standardised_l1_fit(x, y, c)
    per_head = FEATURES_PER_HEAD[feature]
    n_head_cols = len(heads) * per_head
    head_w = w[:n_head_cols].reshape(len(heads), per_head)
    keep = [j for j in range(len(heads)) if np.any(np.abs(head_w[j]) > 1e-9)]
    if heads and not keep:  # a config hooks at least one head: keep the first, weight 0
        keep = [0]
    raw_w = (w[:n_head_cols] / std[:n_head_cols]).reshape(len(heads), per_head)
    # the head part on the raw feature scale: z = b - sum(w * mean / std) + sum(w / std * f)
    bias = b - float(np.dot(w[:n_head_cols], mean[:n_head_cols] / std[:n_head_cols]))
    top = data_top or {}
    first_top = x.shape[1] - len(top)  # the pooled columns come last, in layer order
    top_columns = {
        layer: (float(w[first_top + j]), float(mean[first_top + j]), float(std[first_top + j]))
        for j, layer in enumerate(sorted(top))
    }
    if any(weight < -1e-9 for weight, _, _ in top_columns.values()):
        return fit_combined(
            stats, heads, hidden, labels, groups, feature, c_grid, folds, seed, data_mean
        )
    return CombinedFit(
        heads=[tuple(heads[j]) for j in keep],  # type: ignore[misc]
        weights=[float(v) for j in keep for v in raw_w[j]],
        bias=bias,
        hidden=_hidden_parts(w, mean, std, n_head_cols, hidden, data_mean, data_top),
        feature=feature,
        c=c,
        cv_auroc=float(cv_auroc),
        oof_focus=focus_from_logit(oof_logit),
        top_columns={k: v for k, v in top_columns.items() if abs(v[0]) > 1e-9},
    )


def combined_focus(
    fit: CombinedFit,
    stats: np.ndarray,
    heads: Sequence[HeadKey],
    hidden: Mapping[int, np.ndarray],
    data_mean: Mapping[int, np.ndarray] | None = None,
    data_top: Mapping[int, np.ndarray] | None = None,
) -> np.ndarray:
    """The focus a config made from ``fit`` gives each row (vectorised ``config.focus``):
    ``stats [rows, heads, 5]`` with column j = ``heads[j]``, ``hidden`` and ``data_mean``
    ``{layer: [rows, size]}``, ``data_top`` ``{layer: [rows]}`` (the rows' pooled token
    logits, for a fit that reads them)."""
    column = {tuple(h): j for j, h in enumerate(heads)}
    cols = [column[tuple(h)] for h in fit.heads]
    feats = head_features(stats[:, cols], fit.feature)
    logit = fit.bias + feats @ np.asarray(fit.weights)
    for layer, (weight, mean, std) in fit.top_columns.items():
        logit = logit + weight * (np.asarray((data_top or {})[layer]) - mean) / std
    for part in fit.hidden:
        if part.position == "data_top":
            continue  # its pooled column, above
        streams = hidden if part.position == "last" else (data_mean or {})
        x = np.asarray(streams[part.layer], dtype=np.float64)[:, part.dims]
        logit = logit + ((x - part.mean) / np.asarray(part.scale)) @ np.asarray(part.weights)
    return focus_from_logit(logit)


def worst_source_threshold(
    focus: np.ndarray, labels: np.ndarray, sources: Sequence[str], fpr: float
) -> tuple[float, dict[str, float]]:
    """The threshold that flags at most ``fpr`` of the clean rows of *every* source (the lowest
    of the per-source thresholds), and each source's own threshold.

    Example:
        >>> f = np.r_[np.linspace(0.5, 1, 100), np.linspace(0.2, 1, 100)]
        >>> t, per = worst_source_threshold(f, np.zeros(200, int), ["a"] * 100 + ["b"] * 100, 0.01)
        >>> round(t, 3), sorted(per)
        (0.204, ['a', 'b'])
    """
    labels = np.asarray(labels)
    names = np.asarray(sources)
    per: dict[str, float] = {}
    for name in sorted(set(names.tolist())):
        clean = (names == name) & (labels == 0)
        if clean.sum() >= 20:  # fewer clean rows cannot resolve a 1 % quantile
            per[name] = float(threshold_at_fpr(focus[clean], labels[clean], fpr))
    if not per:
        clean = labels == 0
        return float(threshold_at_fpr(focus[clean], labels[clean], fpr)), per
    return min(per.values()), per


def worst_source_thresholds(
    focus: np.ndarray,
    labels: np.ndarray,
    sources: Sequence[str],
    rates: Sequence[float] = OPERATING_RATES,
) -> dict[float, float]:
    """:func:`worst_source_threshold` at each of ``rates``: a calibration's operating points.

    Example:
        >>> f = np.linspace(0.2, 1, 200)
        >>> points = worst_source_thresholds(f, np.zeros(200, int), ["a"] * 200)
        >>> sorted(points) == [0.01, 0.02, 0.05] and points[0.01] < points[0.05]
        True
    """
    return {rate: worst_source_threshold(focus, labels, sources, rate)[0] for rate in rates}
