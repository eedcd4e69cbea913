"""The token models' two fitters minimise the same objective: torch's L-BFGS (what a GPU
calibration uses) reaches scikit-learn's optimum or a lower point of the same objective, and
``fit_token_model`` gathers exactly each row's own samples."""

from __future__ import annotations

import numpy as np
import pytest

from guardrail.errors import ConfigError
from guardrail.offline.datasets import ScoreTable
from guardrail.offline.token_readout import TokenModel, fit_token_model, fit_tokens


def _data(n: int = 4000, width: int = 48, seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (n, width)) * rng.uniform(0.2, 3, width) + rng.normal(0, 2, width)
    y = (x @ rng.normal(0, 1, width) / 8 + rng.logistic(0, 1, n) > 0).astype(int)
    return x.astype(np.float32), y


def _objective(model: TokenModel, x: np.ndarray, y: np.ndarray) -> float:
    """scikit-learn's L2 logistic objective at ``model``, on the standardised streams."""
    std = x.astype(np.float64).std(0) + 1e-6
    weights = model.coef * std
    margin = (2 * y - 1) * model.logits(x)
    return float(np.logaddexp(0, -margin).mean() + weights @ weights / (2 * model.c * len(y)))


@pytest.mark.parametrize("c", [0.01, 0.2])
def test_torch_reaches_scikit_learns_optimum(c: float) -> None:
    x, y = _data()
    host = fit_tokens(x, y, layers=(3,), c=c)
    torch_fit = fit_tokens(x, y, layers=(3,), c=c, device="cpu")
    assert _objective(torch_fit, x, y) <= _objective(host, x, y) + 1e-9
    spread = np.ptp(host.logits(x))
    assert np.abs(torch_fit.logits(x) - host.logits(x)).max() < 2e-3 * spread
    assert (torch_fit.layers, torch_fit.c) == ((3,), c)


def test_a_models_samples_are_its_rows_own() -> None:
    """A token model is fitted on its rows' sampled tokens only; a model of several layers on
    their streams at each token side by side (ascending layers), its coefficients then split
    back per layer."""
    x, _ = _data(60, 5)
    x2, _ = _data(60, 5, seed=1)
    counts = [7, 0, 13, 9, 31]
    offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
    table = ScoreTable(
        "m",
        [(0, 0)],
        list("abcde"),
        np.zeros((5, 1, 5)),
        np.arange(5),
        np.arange(5),
        tokens={4: x, 2: x2},
        token_offsets=offsets,
    )
    labels = np.array([0, 1, 1, 0, 1])
    rows = np.array([4, 0, 2])
    fitted = fit_token_model(table, rows, labels, layers=(4,), c=0.05)
    parts = [x[offsets[r] : offsets[r + 1]] for r in rows]
    y = np.repeat(labels[rows], [len(p) for p in parts])
    expected = fit_tokens(np.concatenate(parts), y, (4,), 0.05)
    np.testing.assert_array_equal(fitted.coef, expected.coef)
    assert fitted.intercept == expected.intercept
    both = fit_token_model(table, rows, labels, layers=(4, 2), c=0.05)
    side_by_side = [
        np.c_[x2[offsets[r] : offsets[r + 1]], x[offsets[r] : offsets[r + 1]]] for r in rows
    ]
    expected = fit_tokens(np.concatenate(side_by_side), y, (2, 4), 0.05)
    assert both.layers == (2, 4)
    np.testing.assert_array_equal(both.coef, expected.coef)
    assert [(layer, len(c)) for layer, c in both.layer_coef()] == [(2, 5), (4, 5)]
    with pytest.raises(ConfigError, match=r"no sampled token streams of layers \[7\]"):
        fit_token_model(table, rows, labels, layers=(4, 7), c=0.05)


def test_the_torch_fit_leaves_the_callers_streams_alone() -> None:
    x, y = _data(500, 6)
    x = x.astype(np.float64)
    before = x.copy()
    fit_tokens(x, y, layers=(0,), c=0.1, device="cpu")
    np.testing.assert_array_equal(x, before)


def test_a_device_out_of_memory_fits_on_the_host(monkeypatch) -> None:
    """A GPU that cannot hold the samples (CUDA's out-of-memory error; not reachable on a CPU
    machine, so raised here in the torch fitter's place) gives the host's fit and a warning,
    never a failed calibration."""
    import torch

    from guardrail.offline import token_readout

    def out_of_memory(*args: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.50 GiB")

    x, y = _data(600, 12)
    monkeypatch.setattr(token_readout, "_fit_torch", out_of_memory)
    with pytest.warns(RuntimeWarning, match="ran out of memory for 600 x 12 samples"):
        fallen_back = fit_tokens(x, y, layers=(2,), c=0.2, device="cuda")
    host = fit_tokens(x, y, layers=(2,), c=0.2)
    np.testing.assert_array_equal(fallen_back.coef, host.coef)
    assert fallen_back.intercept == host.intercept
