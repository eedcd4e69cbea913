"""Fits that transfer: the probe kinds fitted on scored calibration rows, their thresholds, and
each measured on rows a fit never saw (a source left out, a test set).

Every function here works offline on what the serving probe measured once per row (a
:class:`~guardrail.offline.datasets.ScoreTable` read with every head, the last-token stream of
candidate layers and their data-mean stream), so every kind sees the same rows:

- ``attention``: an L1 logistic on the attention features of every head of the recipe's layers;
- ``hidden``: the same on hidden-state coordinates alone (used to rank candidate layers);
- ``combined``: both in one sparse model (last-token streams and data-mean streams).

A fit's threshold flags at most ``target_fpr`` of the clean rows of *every* calibration source
(the lowest per-source threshold, on out-of-fold focus). :class:`TransferRecipe` is the whole
recipe as frozen data; :func:`recipe_for` gives the one that made a shipped config.

Example:
    >>> recipe = recipe_for("HuggingFaceTB/SmolLM2-135M-Instruct", 30)
    >>> recipe.attention_layers, recipe.hidden_candidates
    ((7, 14, 15, 17, 21), (6, 10, 13, 15, 18, 21, 25))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

import numpy as np

from guardrail.errors import ConfigError
from guardrail.offline.calibration import choose_budget, greedy_layer_sweep, group_folds
from guardrail.offline.combined import (
    CombinedFit,
    combined_focus,
    fit_combined,
    worst_source_threshold,
    worst_source_thresholds,
)
from guardrail.offline.datasets import LabelledPair, ScoreTable
from guardrail.offline.evaluation import auroc, tpr_at_fpr
from guardrail.offline.token_readout import TokenColumn
from guardrail.probe.scoring import FeatureKind, HeadKey, head_features

__all__ = [
    "LINKED_SOURCES",
    "FitKind",
    "LeftOut",
    "Measured",
    "ProbeFit",
    "ScoredPool",
    "TransferRecipe",
    "choose_attention_layers",
    "choose_hidden_layers",
    "fit_probe",
    "leave_one_source_out",
    "left_out_rows",
    "measure",
    "per_layout",
    "probe_focus",
    "recipe_for",
]

FitKind = Literal["attention", "hidden", "combined"]

LINKED_SOURCES: Mapping[str, str] = {"bipia": "bipia_everyday", "bipia_everyday": "bipia"}
"""Sources made from the same contexts: leaving one out leaves the other out too."""


@dataclass(frozen=True)
class TransferRecipe:
    """Everything a pool calibration chooses by rule, as data.

    ``attention_layers``: layers whose heads the attention features come from (None: chosen
    by a greedy layer sweep, at most ``max_attention_layers``); ``hidden_candidates``: layers
    whose last-token stream is scored, the ``hidden_count`` best by a hidden-only probe's
    grouped-CV AUROC are read; ``data_mean_layers``: layers read averaged over the data tokens
    (None: the first of the chosen last-token layers); ``token_layers``: how many layers the
    token read-out reads at each data token (the first data-mean layer, then the candidates
    ranked best by that probe).
    """

    attention_layers: tuple[int, ...] | None
    hidden_candidates: tuple[int, ...]
    hidden_count: int = 2
    data_mean_layers: tuple[int, ...] | None = None
    max_attention_layers: int = 5
    feature: FeatureKind = "attention_stats"
    c_grid: tuple[float, ...] = (0.01, 0.03, 0.1)
    folds: int = 3
    seed: int = 0
    target_fpr: float = 0.01
    token_layers: int = 3

    def scored_layers(self) -> tuple[int, ...]:
        """The layers whose streams are scored (last token and data mean alike)."""
        return tuple(sorted({*self.hidden_candidates, *(self.data_mean_layers or ())}))


SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_PINNED: Mapping[str, TransferRecipe] = {
    # The recipe of the shipped SmolLM2 configs: heads of the layers the config shipped before
    # them hooked, seven candidate stream layers (the shipped read-out chose 15 and 18).
    SMOLLM2_ID: TransferRecipe(
        attention_layers=(7, 14, 15, 17, 21), hidden_candidates=(6, 10, 13, 15, 18, 21, 25)
    ),
}


def recipe_for(model_id: str, num_layers: int) -> TransferRecipe:
    """The recipe that made ``model_id``'s shipped configs, else the generic one: seven
    candidate stream layers spread over the depth, attention layers by the layer sweep."""
    if model_id in _PINNED:
        return _PINNED[model_id]
    top = max(num_layers - 2, 0)  # the last layer's stream is the head's input: not read
    candidates = sorted({round(i * top / 7) for i in range(1, 8)})
    return TransferRecipe(attention_layers=None, hidden_candidates=tuple(candidates))


@dataclass
class ScoredPool:
    """Scored rows as arrays: labels, source (``extra["corpus"]``), layout, group, role
    (``extra["role"]``, "calibration" unless a row says otherwise) and the score table."""

    rows: list[LabelledPair]
    table: ScoreTable
    labels: np.ndarray = field(init=False)
    corpus: np.ndarray = field(init=False)
    layout: np.ndarray = field(init=False)
    role: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.table.keys):
            raise ConfigError(f"{len(self.rows)} rows but {len(self.table.keys)} scored")
        self.labels = np.array([r.label for r in self.rows])
        self.corpus = np.array([str(r.extra.get("corpus") or r.task) for r in self.rows])
        self.layout = np.array([str(r.extra.get("layout", "pair")) for r in self.rows])
        self.role = np.array([str(r.extra.get("role", "calibration")) for r in self.rows])

    @property
    def calibration(self) -> np.ndarray:
        """Indices of the calibration rows."""
        return np.flatnonzero(self.role == "calibration")

    def groups(self, index: np.ndarray) -> list[str]:
        return [self.rows[i].group for i in index]

    def head_columns(self, layers: Sequence[int]) -> list[int]:
        """Columns of the table's heads on ``layers`` (table order)."""
        wanted = set(layers)
        return [j for j, (layer, _) in enumerate(self.table.heads) if layer in wanted]


@dataclass(frozen=True)
class ProbeFit:
    """A probe of one kind fitted on some rows, with its threshold and what it reads."""

    kind: FitKind
    fit: CombinedFit
    threshold: float
    per_source: dict[str, float]
    attention_layers: tuple[int, ...]
    last_layers: tuple[int, ...]
    data_mean_layers: tuple[int, ...]
    rows: int
    data_top: dict[int, TokenColumn] = field(default_factory=dict)  # its rows' pooled logits
    # the worst-source threshold at each of ``OPERATING_RATES`` (calibration.py; out of fold)
    operating: dict[float, float] = field(default_factory=dict)


def _inputs(
    pool: ScoredPool,
    index: np.ndarray,
    attention: Sequence[int],
    last: Sequence[int],
    means: Sequence[int],
) -> tuple[np.ndarray, list[HeadKey], dict[int, np.ndarray], dict[int, np.ndarray]]:
    cols = pool.head_columns(attention)
    stats = pool.table.values[index][:, cols]
    heads = [pool.table.heads[j] for j in cols]
    hidden = {layer: pool.table.hidden[layer][index] for layer in last}
    data_mean = {layer: pool.table.data_mean[layer][index] for layer in means}
    return stats, heads, hidden, data_mean


def fit_probe(
    pool: ScoredPool,
    kind: FitKind,
    index: np.ndarray,
    recipe: TransferRecipe,
    attention_layers: Sequence[int] = (),
    last_layers: Sequence[int] = (),
    data_mean_layers: Sequence[int] = (),
    data_top: Mapping[int, TokenColumn] | None = None,
) -> ProbeFit:
    """A ``kind`` probe fitted on rows ``index``: C by grouped CV on ``recipe.c_grid``, the
    threshold at ``recipe.target_fpr`` on the worst source (out-of-fold focus). ``data_top``:
    token read-outs (their pooled logits on rows ``index``, out of fold), combined kind only."""
    attention = tuple(attention_layers) if kind != "hidden" else ()
    last = tuple(last_layers) if kind != "attention" else ()
    means = tuple(data_mean_layers) if kind != "attention" else ()
    stats, heads, hidden, data_mean = _inputs(pool, index, attention, last, means)
    fit = fit_combined(
        stats,
        heads,
        hidden,
        pool.labels[index],
        pool.groups(index),
        feature=recipe.feature,
        c_grid=recipe.c_grid,
        folds=recipe.folds,
        seed=recipe.seed,
        data_mean=data_mean,
        data_top=data_top if kind == "combined" else None,
    )
    labels, sources = pool.labels[index], pool.corpus[index].tolist()
    threshold, per_source = worst_source_threshold(
        fit.oof_focus, labels, sources, recipe.target_fpr
    )
    operating = worst_source_thresholds(fit.oof_focus, labels, sources)
    tops = {layer: c for layer, c in (data_top or {}).items() if layer in fit.top_columns}
    return ProbeFit(
        kind, fit, threshold, per_source, attention, last, means, len(index), tops, operating
    )


def probe_focus(
    pool: ScoredPool,
    probe: ProbeFit,
    index: np.ndarray,
    data_top: Mapping[int, np.ndarray] | None = None,
) -> np.ndarray:
    """The focus ``probe`` gives rows ``index`` (what its config gives them when served);
    ``data_top``: the rows' pooled token logits, for a probe that reads them."""
    stats, heads, hidden, data_mean = _inputs(
        pool, index, probe.attention_layers, probe.last_layers, probe.data_mean_layers
    )
    return combined_focus(probe.fit, stats, heads, hidden, data_mean, data_top)


class Measured(TypedDict):
    """Detection on some rows at a threshold: counts, AUROC and TPR at 1 % FPR of
    ``1 - focus``, shares of clean rows flagged and injections caught (None: no such rows)."""

    n_clean: int
    n_injected: int
    auroc: float | None
    tpr_at_1pct_fpr: float | None
    flagged_clean: float | None
    caught: float | None


def _share(mask: np.ndarray) -> float | None:
    return round(float(mask.mean()), 4) if len(mask) else None


def measure(labels: np.ndarray, focus: np.ndarray, threshold: float) -> Measured:
    """:class:`Measured` of rows with ``labels`` and ``focus`` at ``threshold``.

    Example:
        >>> measure(np.array([0, 1]), np.array([0.9, 0.1]), 0.5)["caught"]
        1.0
    """
    clean, injected = labels == 0, labels == 1
    both = bool(clean.any() and injected.any())
    risk = 1.0 - focus
    return {
        "n_clean": int(clean.sum()),
        "n_injected": int(injected.sum()),
        "auroc": round(auroc(labels, risk), 4) if both else None,
        "tpr_at_1pct_fpr": round(tpr_at_fpr(labels, risk, 0.01), 4) if both else None,
        "flagged_clean": _share(focus[clean] <= threshold),
        "caught": _share(focus[injected] <= threshold),
    }


def choose_hidden_layers(
    pool: ScoredPool, index: np.ndarray, recipe: TransferRecipe, progress: Any = None
) -> tuple[tuple[int, ...], dict[int, float]]:
    """The ``recipe.hidden_count`` candidate layers whose hidden-only probe has the best
    grouped-CV AUROC on rows ``index`` (ascending), and every candidate's AUROC."""
    scores: dict[int, float] = {}
    for layer in recipe.hidden_candidates:
        probe = fit_probe(pool, "hidden", index, recipe, last_layers=[layer])
        scores[layer] = round(probe.fit.cv_auroc, 4)
        if progress is not None:
            progress(layer)
    best = sorted(scores, key=lambda layer: -scores[layer])[: recipe.hidden_count]
    return tuple(sorted(best)), scores


def choose_attention_layers(
    pool: ScoredPool, index: np.ndarray, recipe: TransferRecipe
) -> tuple[int, ...]:
    """``recipe.attention_layers``, or the fewest layers of a greedy sweep (at most
    ``recipe.max_attention_layers``) within 0.005 CV AUROC of its best."""
    if recipe.attention_layers is not None:
        return recipe.attention_layers
    features = head_features(pool.table.values[index], recipe.feature)
    per_head = features.shape[1] // max(len(pool.table.heads), 1)
    columns = [h for h in pool.table.heads for _ in range(per_head)]
    folds = group_folds(pool.groups(index), recipe.folds, recipe.seed)
    steps = greedy_layer_sweep(
        features, pool.labels[index], columns, folds, recipe.max_attention_layers
    )
    return tuple(choose_budget(steps).layers)


@dataclass(frozen=True)
class LeftOut:
    """One kind measured on a source its fit never saw: per layout (``"all"`` first), the
    rows' labels and focus (for ROC curves), and the fit's thresholds at each rate of
    ``OPERATING_RATES`` (set without the source)."""

    measured: dict[str, Measured]
    labels: np.ndarray
    focus: np.ndarray
    operating: dict[float, float] = field(default_factory=dict)


def left_out_rows(pool: ScoredPool, source: str) -> tuple[np.ndarray, np.ndarray]:
    """(calibration rows fitted on, rows measured) when ``source`` is left out: a linked
    source (``LINKED_SOURCES``) is left out of the fit with it."""
    calibration = pool.calibration
    left_out = [source, LINKED_SOURCES.get(source, source)]
    train = calibration[~np.isin(pool.corpus[calibration], left_out)]
    return train, np.flatnonzero(pool.corpus == source)


def leave_one_source_out(
    pool: ScoredPool,
    probes: Mapping[str, ProbeFit],
    recipe: TransferRecipe,
    progress: Any = None,
    tokens: Mapping[str, tuple[dict[int, TokenColumn], dict[int, np.ndarray]]] | None = None,
) -> dict[str, dict[str, LeftOut]]:
    """For each calibration source: each probe's kind fitted (penalty and threshold too) on
    the other sources (a linked source left out with it) and measured on the source:
    ``{source: {name: LeftOut}}``. ``progress(source)`` after each source. A probe with a
    token read-out is refitted with ``tokens[source]``: the read-out's column on the rows
    fitted on (token models of those rows only, out of fold) and its pooled logits on the
    rows measured (the token model fitted on all of those rows)."""
    calibration = pool.calibration
    out: dict[str, dict[str, LeftOut]] = {}
    for source in sorted(set(pool.corpus[calibration].tolist())):
        train, test = left_out_rows(pool, source)
        if len(set(pool.labels[train].tolist())) == 2:  # else nothing to fit on without it
            out[source] = {}
            for name, probe in probes.items():
                columns, on_test = (
                    (tokens or {}).get(source, ({}, {})) if probe.data_top else ({}, {})
                )
                refit = fit_probe(
                    pool,
                    probe.kind,
                    train,
                    recipe,
                    probe.attention_layers,
                    probe.last_layers,
                    probe.data_mean_layers,
                    columns,
                )
                focus = probe_focus(pool, refit, test, on_test)
                measured = per_layout(pool, test, focus, refit.threshold)
                out[source][name] = LeftOut(measured, pool.labels[test], focus, refit.operating)
        if progress is not None:
            progress(source)
    return out


def per_layout(
    pool: ScoredPool, index: np.ndarray, focus: np.ndarray, threshold: float
) -> dict[str, Measured]:
    """:func:`measure` of rows ``index`` (``focus`` aligned with them) at ``threshold``: all
    rows (``"all"``), then each prompt layout."""
    labels, layouts = pool.labels[index], pool.layout[index]
    out = {"all": measure(labels, focus, threshold)}
    for layout in sorted(set(layouts.tolist())):
        sub = layouts == layout
        out[layout] = measure(labels[sub], focus[sub], threshold)
    return out
