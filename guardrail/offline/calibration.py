"""Calibration math: which heads matter, how to weight them, and where to put the threshold.

Pure functions over per-head scores and ``labels [rows]`` (1 = injected). Head selection
works on focus ``scores [rows, heads]`` (column j is head ``heads[j]``, focus in [0, 1], low =
injection); the logistic probe on feature columns, several per head for some feature kinds.
:func:`calibrate_probes` takes the probe's attention stats ``[rows, heads, 5]`` and derives
both. No model and no engine here: the CLI measures the stats with the serving probe itself.

- Head selection (Attention Tracker): keep head j when
  ``mean_benign - mean_attack - n * (std_benign + std_attack) > 0``, with ``n`` chosen on a
  validation split by the AUROC of the mean focus over the kept heads.
- Learned weighting: an L1-penalised logistic regression predicting injection from the heads'
  features (focus, by default logit(focus), or five attention stats per head:
  :func:`guardrail.probe.scoring.head_features`),
  fitted on standardised features and stored on the raw scale (``weights``, ``bias``).
  Layers are added greedily (a layer-budget sweep) because every hooked layer costs time.
- Thresholds: the midpoint of the class means, and the threshold at a target false-positive
  rate, both on focus (flag when ``focus <= threshold``).

Example:
    >>> rng = np.random.default_rng(0)
    >>> labels = np.r_[np.zeros(50), np.ones(50)].astype(int)
    >>> scores = rng.normal(0.5, 0.05, (100, 3)); scores[labels == 1, 1] -= 0.2
    >>> select_heads(scores, labels, n=1.0).tolist()
    [1]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import ROUND_FLOOR, Decimal
from typing import Any

import numpy as np

from guardrail.errors import ConfigError
from guardrail.offline.evaluation import auroc, tpr_at_fpr
from guardrail.probe.config import Calibration, ModelProbeConfig
from guardrail.probe.scoring import FEATURES_PER_HEAD, FeatureKind, HeadKey, focus_of, head_features

__all__ = [
    "C_GRID",
    "N_CANDIDATES",
    "OPERATING_RATES",
    "LayerStep",
    "LogisticFit",
    "SelectionChoice",
    "choose_budget",
    "choose_c",
    "choose_selection_n",
    "cross_val_focus",
    "fit_l1_logistic",
    "greedy_layer_sweep",
    "group_folds",
    "head_features",
    "head_margins",
    "logistic_focus_array",
    "midpoint_threshold",
    "recorded_threshold",
    "select_heads",
    "standardised_l1_fit",
    "threshold_at_fpr",
]

N_CANDIDATES: tuple[float, ...] = tuple(np.round(np.arange(0.0, 5.01, 0.25), 2))
"""Values of ``n`` tried by the selection rule (the paper searches 0..5)."""
C_GRID: tuple[float, ...] = (0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
"""Inverse L1 strengths tried for the logistic probe (on standardised head scores)."""


def head_margins(scores: np.ndarray, labels: np.ndarray, n: float) -> np.ndarray:
    """Per head: ``mean_benign - mean_attack - n * (std_benign + std_attack)``, shape [heads].

    Example:
        >>> s = np.array([[0.8], [0.6], [0.2], [0.4]]); y = np.array([0, 0, 1, 1])
        >>> head_margins(s, y, 1.0).round(3).tolist()
        [0.2]
    """
    benign, attack = scores[labels == 0], scores[labels == 1]
    if len(benign) == 0 or len(attack) == 0:
        raise ValueError("head selection needs benign and injected rows")
    spread = benign.std(axis=0) + attack.std(axis=0)
    return benign.mean(axis=0) - attack.mean(axis=0) - n * spread


def select_heads(scores: np.ndarray, labels: np.ndarray, n: float) -> np.ndarray:
    """Column indices of the heads the Attention Tracker rule keeps at this ``n``."""
    return np.flatnonzero(head_margins(scores, labels, n) > 0)


@dataclass(frozen=True)
class SelectionChoice:
    """The ``n`` picked on validation, the heads it keeps on all rows, and the search table."""

    n: float | None
    columns: list[int]
    val_auroc: float
    table: list[dict[str, float]] = field(default_factory=list)


def choose_selection_n(
    scores: np.ndarray,
    labels: np.ndarray,
    val_mask: np.ndarray,
    candidates: Sequence[float] = N_CANDIDATES,
) -> SelectionChoice:
    """Pick ``n`` by the validation AUROC of the mean focus of the heads kept on the rest.

    Ties go to the larger ``n`` (fewer heads). The returned heads are re-selected on all rows
    with that ``n``. If no ``n`` keeps a head, the single head with the largest mean gap is
    used and ``n`` is None.

    Example:
        >>> s = np.array([[0.8, 0.5], [0.7, 0.5], [0.3, 0.5], [0.2, 0.5]] * 5)
        >>> y = np.array([0, 0, 1, 1] * 5); val = np.arange(20) >= 12
        >>> choose_selection_n(s, y, val).columns
        [0]
    """
    fit, val = ~val_mask, val_mask
    best: tuple[float, float] | None = None
    table = []
    for n in candidates:
        cols = select_heads(scores[fit], labels[fit], n)
        if len(cols) == 0:
            continue
        score = auroc(labels[val], 1.0 - scores[val][:, cols].mean(axis=1))
        table.append({"n": float(n), "num_heads": len(cols), "val_auroc": round(score, 4)})
        if best is None or score >= best[1]:
            best = (float(n), score)
    if best is None:
        column = int(np.argmax(head_margins(scores, labels, 0.0)))
        score = auroc(labels[val], 1.0 - scores[val][:, column])
        return SelectionChoice(None, [column], score, table)
    columns = select_heads(scores, labels, best[0]).tolist()
    if not columns:  # the chosen n keeps nothing on all rows: relax to the fit-part heads
        columns = select_heads(scores[fit], labels[fit], best[0]).tolist()
    return SelectionChoice(best[0], columns, best[1], table)


def midpoint_threshold(focus: np.ndarray, labels: np.ndarray) -> float:
    """Midpoint of the benign and injected mean focus (the paper's labelled-data rule).

    Example:
        >>> midpoint_threshold(np.array([0.8, 0.6, 0.3]), np.array([0, 0, 1]))
        0.5
    """
    return float((focus[labels == 0].mean() + focus[labels == 1].mean()) / 2)


def threshold_at_fpr(focus: np.ndarray, labels: np.ndarray, fpr: float) -> float:
    """Largest threshold that flags at most ``fpr`` of the benign rows (flag: focus <= t).

    With m benign rows, k = floor(fpr * m) of them may be flagged: the threshold sits just
    below the (k+1)-th lowest benign focus, halfway to the k-th when k >= 1.

    Example:
        >>> benign = np.linspace(0.5, 0.9, 100); focus = np.r_[benign, [0.1, 0.2]]
        >>> labels = np.r_[np.zeros(100), np.ones(2)].astype(int)
        >>> round(threshold_at_fpr(focus, labels, 0.01), 4)
        0.502
    """
    benign = np.sort(focus[labels == 0])
    if len(benign) == 0:
        raise ValueError("a threshold at a false-positive rate needs benign rows")
    k = int(np.floor(fpr * len(benign) + 1e-9))
    if k >= len(benign):
        return 1.0
    upper = benign[k]
    threshold = (benign[k - 1] + upper) / 2 if k >= 1 else np.nextafter(upper, -np.inf)
    return float(np.clip(threshold, 0.0, 1.0))


OPERATING_RATES: tuple[float, ...] = (0.01, 0.02, 0.05)
"""The operating points every calibration records besides its own rate: the thresholds that
flag at most this share of the clean rows (of every calibration source, of all of them, or of
one's own traffic, by writer), which ``ModelProbeConfig.threshold_at`` and
``PromptInjectionPolicy(target_fpr=...)`` read."""


def recorded_threshold(threshold: float) -> float:
    """``threshold`` as a config records it: in [0, 1], to 6 decimals, rounded *down*, so a
    threshold set to flag at most a share of some rows flags no more once written (rounded to
    nearest, one sitting just under the lowest clean focus could be lifted past it). Exact on a
    value that already has 6 decimals.

    Example:
        >>> recorded_threshold(0.0480647), recorded_threshold(0.048065), recorded_threshold(1.2)
        (0.048064, 0.048065, 1.0)
    """
    clipped = float(np.clip(threshold, 0.0, 1.0))
    return float(Decimal(repr(clipped)).quantize(Decimal("1e-6"), rounding=ROUND_FLOOR))


def group_folds(groups: Sequence[str], k: int, seed: int = 0) -> np.ndarray:
    """Fold id per row, whole groups per fold (shuffled, seeded, sizes balanced by rows).

    Example:
        >>> group_folds(["a", "a", "b", "c"], 2).tolist()
        [1, 1, 0, 0]
    """
    unique = sorted(set(groups))
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(unique))
    sizes = {g: 0 for g in unique}
    for g in groups:
        sizes[g] += 1
    load = np.zeros(k)
    fold_of = {}
    for i in order:
        fold = int(np.argmin(load))
        fold_of[unique[i]] = fold
        load[fold] += sizes[unique[i]]
    return np.array([fold_of[g] for g in groups])


def standardised_l1_fit(
    x: np.ndarray, labels: np.ndarray, c: float
) -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
    """L1 logistic regression (class-balanced) on standardised columns of ``x``: (weights,
    intercept, column means, column stds), the weights on the standardised scale."""
    try:
        from sklearn.linear_model import LogisticRegression
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "calibration needs scikit-learn: pip install 'scikit-learn>=1.8'"
        ) from exc
    mean = x.mean(axis=0)
    std = np.maximum(x.std(axis=0), 1e-6)
    model = LogisticRegression(
        C=c,
        l1_ratio=1.0,
        solver="liblinear",
        class_weight="balanced",
        intercept_scaling=10.0,
        max_iter=2000,
        random_state=0,  # liblinear shuffles coordinates: fix it so configs reproduce
    )
    model.fit((x - mean) / std, labels)
    return model.coef_[0], float(model.intercept_[0]), mean, std


def fit_l1_logistic(scores: np.ndarray, labels: np.ndarray, c: float) -> tuple[np.ndarray, float]:
    """L1 logistic regression of injection on head scores; (weights, bias) on the raw scale.

    Scores are standardised for the fit (so the penalty treats heads alike) and the weights
    are folded back: ``z = bias + scores @ weights`` is the logit of P(injection).

    Example:
        >>> s = np.array([[0.9], [0.8], [0.2], [0.1]]); y = np.array([0, 0, 1, 1])
        >>> w, b = fit_l1_logistic(s, y, 10.0); bool(w[0] < 0)
        True
    """
    weights, intercept, mean, std = standardised_l1_fit(scores, labels, c)
    coef = weights / std
    return coef, float(intercept - coef @ mean)


def logistic_focus_array(scores: np.ndarray, weights: np.ndarray, bias: float) -> np.ndarray:
    """Vectorised :func:`guardrail.probe.scoring.logistic_focus`: 1 - sigmoid(bias + scores @ w)."""
    z = np.clip(bias + scores @ weights, -500, 500)
    return 1.0 / (1.0 + np.exp(z))


def cross_val_focus(
    scores: np.ndarray, labels: np.ndarray, folds: np.ndarray, c: float
) -> np.ndarray:
    """Out-of-fold logistic focus of every row (each row scored by a model that never saw it)."""
    focus = np.empty(len(labels))
    for fold in np.unique(folds):
        test = folds == fold
        weights, bias = fit_l1_logistic(scores[~test], labels[~test], c)
        focus[test] = logistic_focus_array(scores[test], weights, bias)
    return focus


def _cv_metrics(
    scores: np.ndarray, labels: np.ndarray, folds: np.ndarray, c: float
) -> dict[str, float]:
    risk = 1.0 - cross_val_focus(scores, labels, folds, c)
    return {
        "cv_auroc": auroc(labels, risk),
        "cv_tpr@1%fpr": tpr_at_fpr(labels, risk, 0.01),
        "cv_tpr@5%fpr": tpr_at_fpr(labels, risk, 0.05),
    }


def choose_c(
    scores: np.ndarray, labels: np.ndarray, folds: np.ndarray, grid: Sequence[float] = C_GRID
) -> tuple[float, dict[str, float]]:
    """The C with the best cross-validated AUROC (ties: the smaller C, i.e. sparser)."""
    best: tuple[float, dict[str, float]] | None = None
    for c in grid:
        metrics = _cv_metrics(scores, labels, folds, c)
        if best is None or metrics["cv_auroc"] > best[1]["cv_auroc"] + 1e-9:
            best = (c, metrics)
    assert best is not None, "C grid is empty"
    return best


@dataclass(frozen=True)
class LayerStep:
    """One budget of the sweep: the hooked layers and the cross-validated metrics."""

    layers: list[int]
    c: float
    metrics: dict[str, float]


def _columns_of(heads: Sequence[HeadKey], layers: Sequence[int]) -> np.ndarray:
    chosen = set(layers)
    return np.array([j for j, (layer, _) in enumerate(heads) if layer in chosen])


def greedy_layer_sweep(
    scores: np.ndarray,
    labels: np.ndarray,
    heads: Sequence[HeadKey],
    folds: np.ndarray,
    max_layers: int,
    progress: Any = None,
) -> list[LayerStep]:
    """Add layers one at a time, each time the one whose heads raise the CV AUROC most.

    Candidates are compared at C = 1; each step's C is then chosen on the grid. ``progress``
    is an optional callable ``(done, total)`` for a progress bar.

    Example:
        >>> rng = np.random.default_rng(1); y = np.r_[np.zeros(40), np.ones(40)].astype(int)
        >>> s = rng.normal(0.5, 0.1, (80, 4)); s[y == 1, 2] -= 0.3
        >>> steps = greedy_layer_sweep(s, y, [(0, 0), (0, 1), (1, 0), (1, 1)],
        ...                            group_folds([str(i) for i in range(80)], 4), 1)
        >>> steps[0].layers
        [1]
    """
    all_layers = sorted({layer for layer, _ in heads})
    chosen: list[int] = []
    steps: list[LayerStep] = []
    for step in range(min(max_layers, len(all_layers))):
        best: tuple[float, int] | None = None
        for layer in (x for x in all_layers if x not in chosen):
            cols = _columns_of(heads, [*chosen, layer])
            risk = 1.0 - cross_val_focus(scores[:, cols], labels, folds, 1.0)
            score = auroc(labels, risk)
            if best is None or score > best[0]:
                best = (score, layer)
        assert best is not None
        chosen = sorted([*chosen, best[1]])
        c, metrics = choose_c(scores[:, _columns_of(heads, chosen)], labels, folds)
        steps.append(LayerStep(list(chosen), c, metrics))
        if progress is not None:
            progress(step + 1, min(max_layers, len(all_layers)))
    return steps


def choose_budget(steps: Sequence[LayerStep], tolerance: float = 0.005) -> LayerStep:
    """The fewest layers whose CV AUROC is within ``tolerance`` of the sweep's best.

    Example:
        >>> a = LayerStep([1], 1.0, {"cv_auroc": 0.90})
        >>> b = LayerStep([1, 2], 1.0, {"cv_auroc": 0.93})
        >>> choose_budget([a, b]).layers
        [1, 2]
    """
    best = max(step.metrics["cv_auroc"] for step in steps)
    return next(s for s in steps if s.metrics["cv_auroc"] >= best - tolerance)


@dataclass(frozen=True)
class LogisticFit:
    """A fitted sparse probe: the heads with a non-zero weight, their weights (all of a kept
    head's features, head-major) and the bias."""

    heads: list[HeadKey]
    weights: list[float]
    bias: float
    c: float
    oof_focus: np.ndarray


def fit_logistic_probe(
    scores: np.ndarray,
    labels: np.ndarray,
    heads: Sequence[HeadKey],
    folds: np.ndarray,
    layers: Sequence[int],
    c: float,
    per_head: int = 1,
) -> LogisticFit:
    """Fit on all rows over the feature columns of ``layers``; keep heads with a non-zero weight.

    Column j of ``scores`` is a feature of head ``heads[j]``; a head's ``per_head`` features
    are adjacent. A head is kept with all its features when any of them has a weight.
    ``oof_focus`` is the out-of-fold focus of each row with the same layers and C, which is
    what thresholds are set on (in-sample scores would be optimistic).

    Example:
        >>> rng = np.random.default_rng(0); y = np.r_[np.zeros(30), np.ones(30)].astype(int)
        >>> x = rng.normal(0, 1, (60, 4)); x[y == 1, 3] += 2  # head (0, 1), second feature
        >>> fit = fit_logistic_probe(x, y, [(0, 0), (0, 0), (0, 1), (0, 1)],
        ...                          group_folds([str(i) for i in range(60)], 3), [0], 0.05, 2)
        >>> fit.heads, len(fit.weights)
        ([(0, 1)], 2)
    """
    cols = _columns_of(heads, layers)
    weights, bias = fit_l1_logistic(scores[:, cols], labels, c)
    keep = np.flatnonzero((np.abs(weights) > 1e-9).reshape(-1, per_head).any(axis=1))
    if len(keep) == 0:  # everything penalised away: keep the single strongest head, unpenalised
        margins = np.abs(head_margins(scores[:, cols], labels, 0.0)).reshape(-1, per_head)
        keep = np.array([int(np.argmax(margins.max(axis=1)))])
        block = [int(keep[0]) * per_head + f for f in range(per_head)]
        weights = np.zeros(len(cols))
        weights[block], bias = fit_l1_logistic(scores[:, cols[block]], labels, 1e4)
    oof = cross_val_focus(scores[:, cols], labels, folds, c)
    kept = [int(j) * per_head + f for j in keep for f in range(per_head)]
    return LogisticFit(
        [heads[cols[int(j) * per_head]] for j in keep],
        [float(weights[j]) for j in kept],
        bias,
        c,
        oof,
    )


@dataclass(frozen=True)
class CalibrationSettings:
    """Knobs of :func:`calibrate_probes`; the defaults are what ``guardrail calibrate`` uses."""

    target_fpr: float = 0.01
    threshold_rule: str = "fpr"  # "fpr" (at target_fpr) or "midpoint"
    max_layers: int = 6
    budget_tolerance: float = 0.005
    budget: int | str = "auto"  # "auto" (fewest layers near the best), "all", or a layer count
    probe: str = "auto"  # "auto", "logistic" or "mean_focus"
    feature: FeatureKind = "logit_focus"  # what the logistic probe weighs per head
    folds: int = 5
    seed: int = 0


def _thresholds(
    focus: np.ndarray, labels: np.ndarray, settings: CalibrationSettings
) -> tuple[float, dict[str, float]]:
    values = {"midpoint": midpoint_threshold(focus, labels)}
    for fpr in sorted({settings.target_fpr, *OPERATING_RATES}):
        values[f"fpr@{fpr:g}"] = threshold_at_fpr(focus, labels, fpr)
    values = {k: recorded_threshold(v) for k, v in values.items()}
    key = "midpoint" if settings.threshold_rule == "midpoint" else f"fpr@{settings.target_fpr:g}"
    return values[key], values


def _mean_focus_cv(
    scores: np.ndarray, labels: np.ndarray, folds: np.ndarray, n: float | None, fallback: list[int]
) -> np.ndarray:
    focus = np.empty(len(labels))
    for fold in np.unique(folds):
        test = folds == fold
        cols = select_heads(scores[~test], labels[~test], n) if n is not None else fallback
        cols = cols if len(cols) else fallback
        focus[test] = scores[test][:, cols].mean(axis=1)
    return focus


def _mean_focus_probe(
    scores: np.ndarray,
    labels: np.ndarray,
    heads: Sequence[HeadKey],
    folds: np.ndarray,
    settings: CalibrationSettings,
) -> tuple[dict[str, Any], SelectionChoice]:
    """The published probe: heads by the selection rule (n on fold 0), mean focus."""
    choice = choose_selection_n(scores, labels, folds == 0)
    mf_oof = _mean_focus_cv(scores, labels, folds, choice.n, choice.columns)
    threshold, values = _thresholds(scores[:, choice.columns].mean(axis=1), labels, settings)
    probe = {
        "heads": [heads[j] for j in choice.columns],
        "weights": None,
        "bias": 0.0,
        "threshold": threshold,
        "thresholds": values,
        "cv_auroc": auroc(labels, 1.0 - mf_oof),
        "oof_focus": mf_oof,
        "notes": f"Attention Tracker head rule, n={choice.n} chosen on a validation split "
        f"(AUROC {choice.val_auroc:.3f}); thresholds on calibration rows",
    }
    return probe, choice


def _budget_step(
    sweep: list[dict[str, Any]], steps: list[LayerStep], settings: CalibrationSettings
) -> tuple[dict[str, Any], str]:
    """The sweep entry of ``settings.budget`` (``sweep`` is ``steps`` then all layers), and
    how it was picked, for the probe's notes."""
    if settings.budget == "all":
        return sweep[-1], f"over all layers ({len(sweep[-1]['layers'])} kept by L1)"
    if settings.budget == "auto":
        budget = choose_budget(steps, settings.budget_tolerance)
        how = (
            f"over {len(budget.layers)} greedily chosen layers (sweep up to "
            f"{settings.max_layers}, within {settings.budget_tolerance} CV AUROC of the best)"
        )
        return sweep[steps.index(budget)], how
    wanted = int(settings.budget)
    if not 1 <= wanted <= len(steps):
        raise ConfigError(
            f"layer budget {wanted} is outside the sweep (1 to {len(steps)} layers); "
            "raise max_layers or pick a smaller budget"
        )
    return sweep[wanted - 1], f"over {wanted} greedily chosen layers (budget set by the user)"


def _logistic_sweep(
    scores: np.ndarray,
    labels: np.ndarray,
    heads: Sequence[HeadKey],
    folds: np.ndarray,
    settings: CalibrationSettings,
    progress: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Fitted probes for each layer budget (then all layers), and the budget to ship.

    Column j of ``scores`` is a feature of head ``heads[j]`` (a head repeats per feature).
    """
    steps = greedy_layer_sweep(scores, labels, heads, folds, settings.max_layers, progress)
    c_all, all_metrics = choose_c(scores, labels, folds)
    steps_all = [*steps, LayerStep(sorted({lay for lay, _ in heads}), c_all, all_metrics)]
    sweep: list[dict[str, Any]] = []
    per_head = FEATURES_PER_HEAD[settings.feature]
    for step in steps_all:
        fit = fit_logistic_probe(scores, labels, heads, folds, step.layers, step.c, per_head)
        threshold, values = _thresholds(fit.oof_focus, labels, settings)
        probe = {
            "heads": fit.heads,
            "weights": fit.weights,
            "bias": fit.bias,
            "feature": settings.feature,
            "threshold": threshold,
            "thresholds": values,
            "oof_focus": fit.oof_focus,
        }
        sweep.append(
            {
                "layers": sorted({lay for lay, _ in fit.heads}),
                "c": step.c,
                **{k: round(v, 4) for k, v in step.metrics.items()},
                "probe": probe,
            }
        )
    picked, how = _budget_step(sweep, steps, settings)
    chosen = {
        **picked["probe"],
        "cv_auroc": picked["cv_auroc"],
        "notes": f"L1 logistic on {settings.feature} {how}, C={picked['c']}; "
        "thresholds on out-of-fold focus",
    }
    return sweep, chosen


def calibrate_probes(
    stats: np.ndarray,
    labels: np.ndarray,
    heads: Sequence[HeadKey],
    groups: Sequence[str],
    settings: CalibrationSettings = CalibrationSettings(),
    progress: Any = None,
) -> dict[str, Any]:
    """Both probe kinds from the probe's attention stats ``[rows, heads, 5]``, plus the layer
    sweep, as plain data.

    Returns ``{"chosen": kind, "probes": {kind: {heads, weights, bias, threshold,
    thresholds, notes, cv_auroc, oof_focus}}, "n_search": [...], "layer_sweep": [...]}``
    (``oof_focus``: each row's out-of-fold focus, ``[rows]``); the CLI turns probes into
    ``ModelProbeConfig`` files. Folds and the validation split keep groups whole.
    """
    folds = group_folds(groups, settings.folds, settings.seed)
    focus = np.asarray(focus_of(stats))
    mean_probe, choice = _mean_focus_probe(focus, labels, heads, folds, settings)
    features = head_features(stats, settings.feature)
    columns = [h for h in heads for _ in range(FEATURES_PER_HEAD[settings.feature])]
    sweep, logistic_probe = _logistic_sweep(features, labels, columns, folds, settings, progress)
    chosen = settings.probe
    if chosen == "auto":
        better = logistic_probe["cv_auroc"] >= mean_probe["cv_auroc"]
        chosen = "logistic" if better else "mean_focus"
    return {
        "chosen": chosen,
        "probes": {"logistic": logistic_probe, "mean_focus": mean_probe},
        "n_search": choice.table,
        "selection_n": choice.n,
        "layer_sweep": sweep,
        "folds": settings.folds,
    }


def retarget_threshold(
    config: ModelProbeConfig,
    clean_focus: np.ndarray,
    target_fpr: float,
    source: str,
    sha256: str,
    max_data_tokens: int | None = None,
) -> tuple[ModelProbeConfig, dict[str, float]]:
    """``config`` with its threshold re-set on clean rows of the user's own traffic.

    The probe (heads, weights) is kept; the threshold becomes the one that flags at most
    ``target_fpr`` of ``clean_focus`` (the focus of clean requests, scored with this config).
    Thresholds at 1 %, 2 % and 5 % are recorded too, under ``traffic fpr@...`` (the config's
    operating points from then on), with the rows'
    description and hash in the notes, so the file says where its operating point came from.
    ``max_data_tokens`` (the longest data of these rows) raises the config's recorded
    ``calibration.max_data_tokens`` when longer: the operating point now rests on them too.
    Returns (new config, {"threshold": new threshold, "flagged_before" / "flagged_after":
    share of these rows the old / new threshold flags (NaN before when there was none)}).

    Example:
        >>> cfg = ModelProbeConfig(model_id="m", heads=[(0, 0)], threshold=0.5)
        >>> new, info = retarget_threshold(cfg, np.linspace(0.2, 0.9, 100), 0.05, "mine", "ab")
        >>> round(new.threshold, 4), info["flagged_before"]
        (0.2318, 0.43)
    """
    clean_focus = np.asarray(clean_focus, dtype=float)
    if clean_focus.size == 0:
        raise ConfigError("re-setting a threshold needs clean rows (label 0, or unlabelled rows)")
    labels = np.zeros(len(clean_focus), dtype=int)
    values = {
        f"traffic fpr@{fpr:g}": recorded_threshold(threshold_at_fpr(clean_focus, labels, fpr))
        for fpr in sorted({target_fpr, *OPERATING_RATES})
    }
    threshold = values[f"traffic fpr@{target_fpr:g}"]
    calibration = config.calibration or Calibration(dataset="", num_examples=0, sha256="")
    note = (
        f"threshold re-set to {threshold:.6f} (was {config.threshold}) at {target_fpr:g} FPR on "
        f"{len(clean_focus)} clean rows of {source} (sha256 {sha256})"
    )
    longest = [n for n in (calibration.max_data_tokens, max_data_tokens) if n is not None]
    new_calibration = calibration.model_copy(
        update={
            "thresholds": {**calibration.thresholds, **values},
            "notes": f"{calibration.notes}; {note}" if calibration.notes else note,
            "max_data_tokens": max(longest) if longest else None,
        }
    )
    new = config.model_copy(update={"threshold": threshold, "calibration": new_calibration})
    before = (
        float(np.mean(clean_focus <= config.threshold)) if config.threshold is not None else None
    )
    return ModelProbeConfig.model_validate(new.model_dump()), {
        "threshold": threshold,
        "flagged_before": round(before, 4) if before is not None else float("nan"),
        "flagged_after": round(float(np.mean(clean_focus <= threshold)), 4),
    }
