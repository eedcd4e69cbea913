"""The token read-out of a pool calibration: every token model it needs, their second pass, and
the choice of C and k (:mod:`guardrail.offline.token_readout` says what the read-out is).

The combined fit is cross-validated by group folds; a pool row's pooled token logit must come
from a token model that did not see the row, so one token model is fitted per fold (the folds of
the combined fit), one on every row (the model a config serves), and the same for each source
left out (on the other sources' rows alone), for each C of ``TOKEN_C_GRID``. All of them are
scored in one second pass (``top_logits_of``), and ``C`` and ``k`` are chosen by the combined
fit's grouped CV AUROC on the pool. The read-out is kept only when it beats the combined fit
without it by more than 1e-4.

Example:
    >>> fits = fit_token_readout(pool, index, recipe, layers, tops_of)  # doctest: +SKIP
    >>> fits.column.top_k, fits.cv  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from guardrail.offline.calibration import group_folds
from guardrail.offline.token_readout import (
    TOKEN_C_GRID,
    TOKEN_K_GRID,
    TokenColumn,
    TokenModel,
    fit_token_models,
    load_token_models,
    pooled,
    problems_sha256,
    save_token_models,
    token_layers,
)
from guardrail.offline.transfer import (
    ProbeFit,
    ScoredPool,
    TransferRecipe,
    fit_probe,
    left_out_rows,
)

__all__ = ["TokenReadoutFit", "fit_token_readout"]

TopLogits = Callable[[list[TokenModel]], np.ndarray]
"""Scores every pool row with token models: ``[pool rows, models, TOP]``
(:func:`guardrail.offline.row_scores.top_token_logits`)."""


@dataclass(frozen=True)
class TokenReadoutFit:
    """The chosen token read-out: its column on the calibration rows (out of fold, with the
    model fitted on all of them), the CV AUROC of every (C, k) tried and of the combined fit
    without it, and each source left out's column and its rows' pooled logits."""

    column: TokenColumn | None  # None: it did not beat the fit without it
    probe: ProbeFit  # the combined fit with the chosen column, or without one
    cv: dict[str, float]  # "C=<c> k=<k>" -> combined CV AUROC; "none" -> without it
    left_out: dict[str, tuple[dict[int, TokenColumn], dict[int, np.ndarray]]]
    models: int  # token models fitted and scored
    layers: tuple[int, ...] = ()  # the layers the token models read


@dataclass
class _Plan:
    """The token models to fit: for each C, one per fold and one on all rows, of the pool and
    of each source left out."""

    models: list[TokenModel]
    where: dict[tuple[str, float, int], int]  # (scope, C, fold; -1: all rows) -> model


def _fit_all(
    pool: ScoredPool,
    scopes: dict[str, np.ndarray],
    folds: dict[str, np.ndarray],
    layers: tuple[int, ...],
    progress: Callable[[str], None],
    device: str | None,
    cache: Path | None = None,
) -> _Plan:
    """Every token model of the plan. On the host, scope after scope; on a device, all of them
    in one run (:func:`fit_token_models`), the scopes' progress steps after it. ``cache``: a
    file that keeps them, read back instead of fitting when it holds the models of these very
    problems and samples (:func:`problems_sha256`): a calibration cut short after its token
    models resumes without fitting them again."""
    plan = _Plan([], {})
    problems: list[tuple[np.ndarray, float]] = []
    parts: dict[str, slice] = {}
    for scope, rows in scopes.items():
        start = len(problems)
        for c in TOKEN_C_GRID:
            for fold in [*np.unique(folds[scope]).tolist(), -1]:
                train = rows if fold == -1 else rows[folds[scope] != fold]
                plan.where[(scope, c, fold)] = len(problems)
                problems.append((train, c))
        parts[scope] = slice(start, len(problems))
    if cache is not None:
        digest = problems_sha256(pool.table, problems, pool.labels, layers)
        held = load_token_models(cache, digest)
        if held is not None:
            plan.models = held
            for scope in scopes:
                progress(f"token models ({scope}, read from {cache.name})")
            return plan
    if device is None:
        for scope, part in parts.items():
            plan.models.extend(fit_token_models(pool.table, problems[part], pool.labels, layers))
            progress(f"token models ({scope})")
    else:
        plan.models = fit_token_models(pool.table, problems, pool.labels, layers, device)
        for scope in scopes:
            progress(f"token models ({scope}, fitted together on {device})")
    if cache is not None:
        save_token_models(cache, digest, plan.models)
    return plan


def _out_of_fold(
    tops: np.ndarray, plan: _Plan, scope: str, rows: np.ndarray, folds: np.ndarray, c: float, k: int
) -> np.ndarray:
    """Each of ``rows``' pooled logit from the model of the fold that did not see it."""
    values = np.empty(len(rows))
    for fold in np.unique(folds):
        at = folds == fold
        values[at] = pooled(tops[rows[at], plan.where[(scope, c, int(fold))]], k)
    return values


def fit_token_readout(
    pool: ScoredPool,
    index: np.ndarray,
    recipe: TransferRecipe,
    attention: Sequence[int],
    last: Sequence[int],
    means: Sequence[int],
    layers: Sequence[int],
    top_logits_of: TopLogits,
    progress: Callable[[str], None] | None = None,
    device: str | None = None,
    models_cache: Path | None = None,
) -> TokenReadoutFit:
    """The token read-out of ``layers`` (their streams at each data token side by side) for
    the combined probe on calibration rows ``index`` (module doc): ``attention``, ``last`` and
    ``means`` are the combined fit's other inputs; ``device``: where the token models are
    fitted (:func:`fit_tokens`); ``models_cache``: a file keeping them between runs (their
    samples' and problems' digest decides whether it holds them). The read-out's column is
    keyed by its last layer, where the serving probe adds its term."""
    step = progress or (lambda _: None)
    chosen_layers = token_layers(layers)
    layer = chosen_layers[-1]
    scopes = {"pool": index}
    for source in sorted(set(pool.corpus[index].tolist())):
        train, _ = left_out_rows(pool, source)
        if len(set(pool.labels[train].tolist())) == 2:
            scopes[source] = train
    folds = {
        scope: group_folds(pool.groups(rows), recipe.folds, recipe.seed)
        for scope, rows in scopes.items()
    }
    plan = _fit_all(pool, scopes, folds, chosen_layers, step, device, models_cache)
    tops = top_logits_of(plan.models)
    step("token read-out pass")
    plain = fit_probe(pool, "combined", index, recipe, attention, last, means)
    cv = {"none": round(plain.fit.cv_auroc, 4)}
    best: tuple[ProbeFit, float, int] | None = None
    for c in TOKEN_C_GRID:
        for k in TOKEN_K_GRID:
            values = _out_of_fold(tops, plan, "pool", index, folds["pool"], c, k)
            column = TokenColumn(values, plan.models[plan.where[("pool", c, -1)]], k)
            fit = fit_probe(
                pool, "combined", index, recipe, attention, last, means, {layer: column}
            )
            cv[f"C={c:g} k={k}"] = round(fit.fit.cv_auroc, 4)
            if fit.data_top and (best is None or fit.fit.cv_auroc > best[0].fit.cv_auroc + 1e-4):
                best = (fit, c, k)
        step(f"token C={c:g}")
    if best is None or best[0].fit.cv_auroc <= plain.fit.cv_auroc + 1e-4:
        return TokenReadoutFit(None, plain, cv, {}, len(plan.models), chosen_layers)
    probe, c, k = best
    chosen = probe.data_top[layer]
    left_out: dict[str, tuple[dict[int, TokenColumn], dict[int, np.ndarray]]] = {}
    for source in scopes:
        if source == "pool":
            continue
        train, test = left_out_rows(pool, source)
        model = plan.where[(source, c, -1)]
        oof = _out_of_fold(tops, plan, source, train, folds[source], c, k)
        left_out[source] = (
            {layer: TokenColumn(oof, plan.models[model], k)},
            {layer: pooled(tops[test, model], k)},
        )
    return TokenReadoutFit(chosen, probe, cv, left_out, len(plan.models), chosen_layers)
