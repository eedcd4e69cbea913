"""The token models' fitters minimise the same objective: torch's L-BFGS (what a GPU
calibration uses), one model at a time or every model of a calibration at once, reaches
scikit-learn's optimum or a lower point of the same objective, and ``fit_token_model(s)``
gather exactly each row's own samples."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from guardrail.errors import ConfigError
from guardrail.offline.datasets import ScoreTable
from guardrail.offline.token_readout import (
    TokenModel,
    fit_token_model,
    fit_token_models,
    fit_tokens,
    fit_tokens_jointly,
)


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


def _token_table(layer: int, x: np.ndarray, counts: np.ndarray) -> ScoreTable:
    """A score table of ``len(counts)`` rows whose sampled tokens of ``layer`` are ``x``'s
    first rows, ``counts[r]`` for row r."""
    offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
    n = len(counts)
    return ScoreTable(
        "m",
        [(0, 0)],
        [f"k{i}" for i in range(n)],
        np.zeros((n, 1, 5)),
        np.arange(n),
        np.arange(n),
        tokens={layer: x[: offsets[-1]]},
        token_offsets=offsets,
    )


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
    machine, so raised here in the joint fitter's place) gives the host's fit and a warning,
    never a failed calibration."""
    import torch

    from guardrail.offline import token_readout

    def out_of_memory(*args: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.50 GiB")

    x, y = _data(600, 12)
    monkeypatch.setattr(token_readout, "fit_tokens_jointly", out_of_memory)
    with pytest.warns(RuntimeWarning, match="ran out of memory for 600 x 12 samples"):
        fallen_back = fit_tokens(x, y, layers=(2,), c=0.2, device="cuda")
    host = fit_tokens(x, y, layers=(2,), c=0.2)
    np.testing.assert_array_equal(fallen_back.coef, host.coef)
    assert fallen_back.intercept == host.intercept


def test_models_fitted_together_reach_each_ones_optimum() -> None:
    """Twelve problems (three C, four sample subsets, as calibration's folds) in one run: each
    model reaches scikit-learn's optimum of its own objective, its samples standardised by their
    own mean and std, and gives the logits of its own fit."""
    x, y = _data(3000, 40)
    folds = np.random.default_rng(5).integers(0, 3, len(y))
    masks = [folds != f for f in range(3)] + [np.ones(len(y), dtype=bool)]
    problems = [(m, c) for c in (0.01, 0.05, 0.2) for m in masks]
    together = fit_tokens_jointly(x, y, problems, layers=(6, 2), device="cpu")
    assert len(together) == len(problems)
    for (mask, c), model in zip(problems, together, strict=True):
        own = fit_tokens(x[mask], y[mask], layers=(2, 6), c=c)
        assert (model.layers, model.c) == ((2, 6), c)
        assert _objective(model, x[mask], y[mask]) <= _objective(own, x[mask], y[mask]) + 1e-9
        spread = np.ptp(own.logits(x[mask]))
        assert np.abs(model.logits(x[mask]) - own.logits(x[mask])).max() < 2e-3 * spread


def test_fit_token_models_gathers_each_problems_rows() -> None:
    """On a device, ``fit_token_models`` fits every (rows, C) at once on the union of their rows'
    samples: each model equals ``fit_token_model`` of its own rows (same optimum)."""
    x, _ = _data(400, 6)
    table = _token_table(3, x, np.random.default_rng(2).integers(0, 9, 60))
    labels = (np.arange(60) % 5 < 2).astype(int)
    problems = [(np.arange(0, 60, 2 + k), c) for k, c in ((0, 0.05), (1, 0.2), (0, 0.2))]
    problems.append((np.array([5, 1, 40, 33, 8, 21, 22, 59]), 0.1))
    together = fit_token_models(table, problems, labels, layers=(3,), device="cpu")
    for (rows, c), model in zip(problems, together, strict=True):
        samples, row_counts = table.token_index(rows)
        xs, ys = table.tokens[3][samples], np.repeat(labels[rows], row_counts)
        own = fit_token_model(table, rows, labels, layers=(3,), c=c)
        assert _objective(model, xs, ys) <= _objective(own, xs, ys) + 1e-9
    host = fit_token_models(table, problems[:2], labels, layers=(3,))
    for (rows, c), model in zip(problems[:2], host, strict=True):
        np.testing.assert_array_equal(
            model.coef, fit_token_model(table, rows, labels, (3,), c).coef
        )


def test_the_read_out_fitted_on_a_device_chooses_as_the_hosts() -> None:
    """``fit_token_readout`` with a torch device fits its models all at once; each equals the
    host's fit of the same scope, fold and C, and the progress steps are the host's."""
    from guardrail.offline.token_fit import fit_token_readout
    from guardrail.offline.token_readout import top_logits
    from tests.unit.test_offline_transfer import RECIPE, synthetic_pool

    base = synthetic_pool(3)
    rng = np.random.default_rng(8)
    n = len(base.rows)
    counts = rng.integers(4, 9, n)
    offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
    tokens = rng.normal(0, 1, (int(offsets[-1]), 8)).astype(np.float32)
    tokens[np.repeat(base.labels == 1, counts), 2] += 1.0
    table = base.table
    table.tokens, table.token_offsets = {1: tokens}, offsets
    pool = type(base)(base.rows, table)
    index = np.flatnonzero(pool.corpus != "test")

    def tops_of(models: list[TokenModel]) -> np.ndarray:
        return np.stack([top_logits(tokens[a:b], models) for a, b in itertools.pairwise(offsets)])

    runs = {}
    for device in (None, "cpu"):
        steps: list[str] = []
        runs[device] = (
            fit_token_readout(
                pool, index, RECIPE, [1], [1], [1], [1], tops_of, steps.append, device
            ),
            steps,
        )
    (host, host_steps), (joint, joint_steps) = runs[None], runs["cpu"]
    assert host.models == joint.models == 5 * 3 * 4  # the pool and 4 sources left out
    assert len(host_steps) == len(joint_steps)
    assert host.cv.keys() == joint.cv.keys()
    for key, value in host.cv.items():
        assert joint.cv[key] == pytest.approx(value, abs=2e-3)


def test_a_device_too_small_for_all_models_fits_them_one_at_a_time(monkeypatch) -> None:
    """Should the device not hold every model's samples at once (CUDA's out-of-memory error,
    raised here in the joint fitter's place), the models are fitted one at a time there: the
    same models, never a failed calibration."""
    import torch

    from guardrail.offline import token_readout

    joint = token_readout.fit_tokens_jointly

    def only_one_fits(x: np.ndarray, y: np.ndarray, problems: list, *args: object) -> list:
        if len(problems) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 13.60 GiB")
        return joint(x, y, problems, *args)

    x, _ = _data(300, 4)
    table = _token_table(1, x, np.full(50, 6))
    labels = (np.arange(50) % 3 == 0).astype(int)
    problems = [(np.arange(0, 50), 0.05), (np.arange(0, 50, 2), 0.2)]
    monkeypatch.setattr(token_readout, "fit_tokens_jointly", only_one_fits)
    fitted = fit_token_models(table, problems, labels, layers=(1,), device="cpu")
    for (rows, c), model in zip(problems, fitted, strict=True):
        alone = fit_token_model(table, rows, labels, (1,), c, device="cpu")
        np.testing.assert_array_equal(model.coef, alone.coef)
        host = fit_token_model(table, rows, labels, (1,), c)  # on the device, not fallen back
        assert not np.array_equal(model.coef, host.coef)
        np.testing.assert_allclose(model.logits(x), host.logits(x), atol=2e-3)


def test_token_models_kept_in_a_file_come_back_only_for_the_same_problems_and_samples(
    tmp_path,
) -> None:
    """The models cache beside a score cache: read back equal, bit for bit, for the digest of
    the same problems and samples; a changed C, row set, label or sampled stream misses it."""
    from guardrail.offline.token_readout import (
        load_token_models,
        problems_sha256,
        save_token_models,
    )

    x, _ = _data(400, 6)
    table = _token_table(3, x, np.random.default_rng(2).integers(0, 9, 60))
    labels = (np.arange(60) % 5 < 2).astype(int)
    problems = [(np.arange(0, 60, 2), 0.05), (np.arange(1, 60, 3), 0.2)]
    models = fit_token_models(table, problems, labels, layers=(3,))
    digest = problems_sha256(table, problems, labels, (3,))
    path = tmp_path / "scores.token-models.npz"
    assert load_token_models(path, digest) is None  # no file yet
    save_token_models(path, digest, models)
    back = load_token_models(path, digest)
    assert back is not None and len(back) == len(models)
    for got, want in zip(back, models, strict=True):
        assert (got.layers, got.intercept, got.c) == (want.layers, want.intercept, want.c)
        np.testing.assert_array_equal(got.coef, want.coef)
    changed_x = x.copy()
    changed_x[7, 2] += 1e-3
    others = [
        problems_sha256(table, [(problems[0][0], 0.01), problems[1]], labels, (3,)),
        problems_sha256(table, [(problems[0][0][1:], 0.05), problems[1]], labels, (3,)),
        problems_sha256(table, problems, np.where(np.arange(60) == 4, 1, labels), (3,)),
        problems_sha256(
            _token_table(3, changed_x, np.diff(table.token_offsets)), problems, labels, (3,)
        ),
    ]
    assert len({digest, *others}) == 5
    assert all(load_token_models(path, other) is None for other in others)


def test_a_joint_fit_stopped_by_its_step_limit_says_so(monkeypatch) -> None:
    """As scikit-learn warns when its solver stops before converging, the joint fit does."""
    from guardrail.offline import token_readout

    monkeypatch.setattr(token_readout, "JOINT_MAX_ITER", 3)
    x, y = _data(500, 8)
    with pytest.warns(RuntimeWarning, match="joint fit of 2 models stopped after [0-9]+ steps"):
        fit_tokens_jointly(x, y, [(np.ones(len(y), bool), 0.1)] * 2, (1,), "cpu")
