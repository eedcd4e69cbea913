"""The combined probe's fit, taken apart into head weights and hidden-state read-outs, gives
the same focus as the standardised L1 fit it came from; an empty C grid is refused."""

from __future__ import annotations

import numpy as np
import pytest

from guardrail.errors import ConfigError
from guardrail.offline.calibration import standardised_l1_fit
from guardrail.offline.combined import (
    combined_focus,
    feature_matrix,
    fit_combined,
    focus_from_logit,
)


def _data(rows: int = 120):
    rng = np.random.default_rng(0)
    labels = np.arange(rows) % 2
    stats = rng.uniform(0.05, 0.95, size=(rows, 2, 5))
    stats[:, 0, 0] = np.where(labels == 1, 0.2, 0.7) + rng.normal(0, 0.1, rows)  # head focus
    stats = stats.clip(0.01, 0.99)
    hidden = {3: rng.normal(size=(rows, 4))}
    hidden[3][:, 2] += 2.0 * labels  # one informative coordinate of the last-token stream
    means = {1: rng.normal(size=(rows, 3))}
    means[1][:, 0] -= 1.5 * labels  # and one of the data-mean stream
    groups = [f"g{i // 2}" for i in range(rows)]
    return stats, [(0, 0), (1, 1)], hidden, means, labels, groups


def test_the_parts_give_the_focus_of_the_whole_fit():
    stats, heads, hidden, means, labels, groups = _data()
    fit = fit_combined(stats, heads, hidden, labels, groups, folds=3, data_mean=means)
    assert fit.cv_auroc > 0.9
    read = {(p.layer, p.position): p.dims for p in fit.hidden}
    assert 2 in read[(3, "last")] and 0 in read[(1, "data_mean")]
    # reference: the standardised fit over every column, at the C the fit chose
    x = feature_matrix(stats, hidden, fit.feature, means)
    w, b, mean, std = standardised_l1_fit(x, labels, fit.c)
    expected = focus_from_logit(b + ((x - mean) / std) @ w)
    actual = combined_focus(fit, stats, heads, hidden, means)
    np.testing.assert_allclose(actual, expected, atol=1e-9)


def test_an_empty_c_grid_is_refused():
    stats, heads, hidden, _, labels, groups = _data(20)
    with pytest.raises(ConfigError, match="c_grid is empty"):
        fit_combined(stats, heads, hidden, labels, groups, c_grid=(), folds=2)


@pytest.mark.parametrize("layers", [(2,), (2, 5)])
def test_a_token_readout_column_becomes_the_data_top_part_a_config_serves(layers):
    """The pooled column of a token model (mean of the k highest token logits) is fitted as one
    column; the ``data_top`` read-outs written for it (one per layer the model reads) give,
    from the raw token streams alone, exactly the logit term the column adds in the fit."""
    from guardrail.offline.token_readout import TokenColumn, fit_tokens, pooled, top_logits
    from guardrail.probe.config import ModelProbeConfig

    stats, heads, hidden, _, labels, groups = _data()
    rng = np.random.default_rng(1)
    width = 6 * len(layers)  # the layers' streams side by side
    tokens = [rng.normal(size=(int(rng.integers(2, 30)), width)) for _ in labels]
    for streams, label in zip(tokens, labels, strict=True):
        if label:  # a few injected tokens stand out on one coordinate of each layer
            streams[: max(1, len(streams) // 5), 4::6] += 3.0
    x = np.concatenate(tokens)
    y = np.concatenate([np.full(len(t), lab) for t, lab in zip(tokens, labels, strict=True)])
    model = fit_tokens(x, y, layers=layers, c=1.0)
    values = pooled(np.concatenate([top_logits(t, [model], 5) for t in tokens]), 3)
    column = TokenColumn(values, model, 3)
    key = layers[-1]
    fit = fit_combined(stats, heads, hidden, labels, groups, folds=3, data_top={key: column})
    parts = [p for p in fit.hidden if p.position == "data_top"]
    assert [p.layer for p in parts] == list(layers) and {p.top_k for p in parts} == {3}
    weight, mean, std = fit.top_columns[key]
    assert weight > 0
    config = ModelProbeConfig(
        model_id="m",
        probe="logistic",
        heads=fit.heads,
        weights=fit.weights,
        hidden=fit.hidden,
        feature=fit.feature,
    )
    served = np.array(
        [
            config.data_top_term({layer: t[:, 6 * j : 6 * j + 6] for j, layer in enumerate(layers)})
            for t in tokens
        ]
    )
    np.testing.assert_allclose(served, weight * (values - mean) / std, atol=1e-9)
    # and the fit's focus is the standardised fit's over every column
    x_all = np.c_[feature_matrix(stats, hidden, fit.feature), values]
    w, b, mu, sd = standardised_l1_fit(x_all, labels, fit.c)
    expected = focus_from_logit(b + ((x_all - mu) / sd) @ w)
    actual = combined_focus(fit, stats, heads, hidden, None, {key: values})
    np.testing.assert_allclose(actual, expected, atol=1e-9)


def test_cross_validation_fits_in_processes_equal_one_at_a_time(monkeypatch):
    """The C x fold fits of a large matrix run in processes: every out-of-fold logit is the one
    a plain loop over the same fits gives, bit for bit (so a config rebuilds byte for byte on
    any core count). On threads they were not: liblinear's random generator is per process."""
    from guardrail.offline import combined
    from guardrail.offline.calibration import group_folds

    monkeypatch.setattr(combined, "PARALLEL_FIT_ELEMENTS", 0)  # this small matrix too
    rng = np.random.default_rng(3)
    y = (rng.random(1500) < 0.4).astype(int)
    x = rng.normal(0, 1, (1500, 300))
    x[y == 1, :20] += 0.3
    folds = group_folds([str(i // 2) for i in range(1500)], 5, 0)
    grid = (0.01, 0.03, 0.3)
    parallel = combined._oof_logits(x, y, folds, grid)
    for c, got in zip(grid, parallel, strict=True):
        want = np.empty(len(y))
        for fold in np.unique(folds):
            test = folds == fold
            w, b, mean, std = standardised_l1_fit(x[~test], y[~test], c)
            want[test] = b + ((x[test] - mean) / std) @ w
        assert np.array_equal(got, want)
    assert not np.array_equal(parallel[0], parallel[2])  # the C mattered
