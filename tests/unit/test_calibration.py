"""Calibration math on synthetic per-head scores: head rule, weighting, thresholds, sweeps."""

from __future__ import annotations

import numpy as np
import pytest

from guardrail.offline.calibration import (
    CalibrationSettings,
    calibrate_probes,
    choose_budget,
    choose_selection_n,
    fit_l1_logistic,
    greedy_layer_sweep,
    group_folds,
    head_features,
    head_margins,
    logistic_focus_array,
    midpoint_threshold,
    select_heads,
    threshold_at_fpr,
)
from guardrail.offline.evaluation import auroc
from guardrail.probe.config import ModelProbeConfig
from guardrail.probe.scoring import FEATURES_PER_HEAD, focus_of

pytest.importorskip("sklearn")

LAYERS, HEADS = 6, 4
GRID = [(layer, head) for layer in range(LAYERS) for head in range(HEADS)]


def synthetic(n_groups: int = 60, seed: int = 0, informative: dict | None = None):
    """Rows of 4 per group (1 clean, 3 injected); ``informative`` maps head -> focus drop."""
    informative = informative or {(2, 1): 0.25, (4, 3): 0.15}
    rng = np.random.default_rng(seed)
    labels = np.tile([0, 1, 1, 1], n_groups)
    groups = [f"g{i // 4}" for i in range(len(labels))]
    scores = rng.normal(0.5, 0.08, (len(labels), len(GRID)))
    for head, drop in informative.items():
        scores[labels == 1, GRID.index(head)] -= drop
    return np.clip(scores, 0, 1), labels, groups


def as_stats(focus: np.ndarray, seed: int = 0) -> np.ndarray:
    """Attention stats [rows, heads, 5] whose focus is ``focus``; the other stats are noise."""
    rng = np.random.default_rng(seed)
    mass = rng.uniform(0.3, 0.9, focus.shape)  # instruction + data; the rest is on the sink
    stats = np.stack(
        [
            focus * mass,
            (1 - focus) * mass,
            1 - mass,
            (1 - focus) * mass * rng.uniform(0.05, 0.3, focus.shape),
            rng.uniform(0.5, 1.0, focus.shape),
        ],
        axis=-1,
    )
    np.testing.assert_allclose(focus_of(stats), focus, atol=1e-6)
    return stats


def test_head_margins_follow_the_published_rule():
    scores, labels, _ = synthetic()
    b, a = scores[labels == 0], scores[labels == 1]
    expected = b.mean(0) - a.mean(0) - 0.7 * (b.std(0) + a.std(0))
    np.testing.assert_allclose(head_margins(scores, labels, 0.7), expected)


def test_selection_keeps_informative_heads_and_shrinks_with_n():
    scores, labels, _ = synthetic()
    strict = set(select_heads(scores, labels, 1.0).tolist())
    loose = set(select_heads(scores, labels, 0.0).tolist())
    assert strict == {GRID.index((2, 1))}
    assert strict <= loose and GRID.index((4, 3)) in loose


def test_n_is_chosen_on_validation_rows():
    scores, labels, groups = synthetic()
    val = group_folds(groups, 4) == 0
    choice = choose_selection_n(scores, labels, val)
    assert choice.n is not None and choice.table
    assert GRID.index((2, 1)) in choice.columns
    best = max(row["val_auroc"] for row in choice.table)
    assert choice.val_auroc == pytest.approx(best, abs=1e-4)


def test_selection_falls_back_to_the_best_head_without_signal():
    scores, labels, groups = synthetic(informative={(0, 0): -0.3})  # injected focus goes *up*
    choice = choose_selection_n(scores, labels, group_folds(groups, 4) == 0, candidates=[5.0])
    assert choice.n is None and len(choice.columns) == 1


def test_midpoint_threshold():
    focus = np.array([0.9, 0.7, 0.3, 0.1])
    assert midpoint_threshold(focus, np.array([0, 0, 1, 1])) == pytest.approx(0.5)


@pytest.mark.parametrize("fpr", [0.0, 0.01, 0.05, 0.2])
def test_threshold_at_fpr_bounds_false_positives(fpr):
    rng = np.random.default_rng(3)
    focus = np.r_[rng.uniform(0.3, 0.9, 400), rng.uniform(0.0, 0.6, 300)]
    labels = np.r_[np.zeros(400), np.ones(300)].astype(int)
    t = threshold_at_fpr(focus, labels, fpr)
    flagged_clean = (focus[labels == 0] <= t).mean()
    assert flagged_clean <= fpr + 1e-12
    # the threshold is as high as allowed: one more clean row would exceed the budget
    next_clean = np.sort(focus[labels == 0])[int(np.floor(fpr * 400))]
    assert t < next_clean and (focus[labels == 0] <= next_clean).mean() > fpr


def test_group_folds_keep_groups_whole_and_balanced():
    groups = [f"g{i // 4}" for i in range(200)]
    folds = group_folds(groups, 5, seed=1)
    for g in set(groups):
        assert len({folds[i] for i, x in enumerate(groups) if x == g}) == 1
    assert sorted(np.bincount(folds).tolist()) == [40] * 5


def assert_serving_matches(stats, features, weights, bias, feature):
    """The config's focus (serving, from per-head stats) equals the fitted model's on 20 rows."""
    per_head = FEATURES_PER_HEAD[feature]
    keep = np.flatnonzero(np.reshape(weights, (-1, per_head)).any(axis=1))
    config = ModelProbeConfig(
        model_id="synthetic",
        probe="logistic",
        feature=feature,
        heads=[GRID[j] for j in keep],
        weights=np.reshape(weights, (-1, per_head))[keep].ravel().tolist(),
        bias=bias,
    )
    expected = logistic_focus_array(features, weights, bias)
    served = [config.focus(dict(zip(GRID, row, strict=True))) for row in stats[:20]]
    np.testing.assert_allclose(served, expected[:20], rtol=1e-9)


def test_l1_logistic_is_sparse_and_matches_the_serving_focus():
    scores, labels, _ = synthetic(n_groups=100)
    weights, bias = fit_l1_logistic(scores, labels, c=0.05)
    nonzero = {GRID[j] for j in np.flatnonzero(weights)}
    assert (2, 1) in nonzero and (4, 3) in nonzero
    assert len(nonzero) <= 8, "the L1 penalty should drop most noise heads"
    assert weights[GRID.index((2, 1))] < 0, "lower focus must mean more likely injected"
    stats = as_stats(scores)
    assert_serving_matches(stats, head_features(stats, "focus"), weights, bias, "focus")


def test_logit_feature_probe_serves_what_calibration_fitted():
    scores, labels, _ = synthetic(n_groups=100)
    scores[0, 0], scores[1, 0] = 0.0, 1.0  # the ends are clipped, not infinite
    stats = as_stats(scores)
    features = head_features(stats, "logit_focus")
    assert np.isfinite(features).all()
    np.testing.assert_allclose(features[2], np.log(scores[2] / (1 - scores[2])), atol=1e-6)
    weights, bias = fit_l1_logistic(features, labels, c=0.05)
    assert_serving_matches(stats, features, weights, bias, "logit_focus")


def test_attention_stats_probe_finds_a_signal_focus_cannot_see():
    # Focus carries nothing; injected rows put their data attention on one token of one head.
    scores, labels, groups = synthetic(n_groups=100, informative={(0, 0): 0.0})
    stats = as_stats(scores)
    peaked = GRID.index((3, 2))
    stats[labels == 1, peaked, 3] = stats[labels == 1, peaked, 1] * 0.9
    stats[labels == 1, peaked, 4] *= 0.3
    settings = CalibrationSettings(max_layers=1, folds=3, feature="attention_stats")
    result = calibrate_probes(stats, labels, GRID, groups, settings)
    log, mean = result["probes"]["logistic"], result["probes"]["mean_focus"]
    assert log["feature"] == "attention_stats"
    assert (3, 2) in [tuple(h) for h in log["heads"]]
    assert len(log["weights"]) == 5 * len(log["heads"])
    assert log["cv_auroc"] > 0.95 and mean["cv_auroc"] < 0.7
    features = head_features(stats, "attention_stats")
    weights = np.zeros(features.shape[1])
    for head, w in zip(log["heads"], np.reshape(log["weights"], (-1, 5)), strict=True):
        j = GRID.index(tuple(head))
        weights[5 * j : 5 * j + 5] = w
    assert_serving_matches(stats, features, weights, log["bias"], "attention_stats")


def test_logistic_weighting_beats_mean_focus_when_heads_differ_in_strength():
    # many weak heads plus one strong one with a large spread: averaging dilutes it
    informative = {(1, h): 0.03 for h in range(4)} | {(3, 0): 0.2}
    scores, labels, groups = synthetic(n_groups=120, informative=informative)
    test_scores, test_labels, _ = synthetic(n_groups=60, seed=9, informative=informative)
    settings = CalibrationSettings(max_layers=2, folds=3)
    result = calibrate_probes(as_stats(scores), labels, GRID, groups, settings)
    log, mean = result["probes"]["logistic"], result["probes"]["mean_focus"]
    cols = [GRID.index(tuple(h)) for h in log["heads"]]
    assert log["feature"] == "logit_focus"  # the default
    features = head_features(as_stats(test_scores, seed=1)[:, cols], log["feature"])
    held_log = 1 - logistic_focus_array(features, np.array(log["weights"]), log["bias"])
    held_mean = 1 - test_scores[:, [GRID.index(tuple(h)) for h in mean["heads"]]].mean(1)
    assert auroc(test_labels, held_log) >= auroc(test_labels, held_mean) - 0.01
    assert auroc(test_labels, held_log) > 0.9


def test_greedy_sweep_finds_the_informative_layer_first():
    scores, labels, groups = synthetic(informative={(4, 0): 0.2, (4, 2): 0.1})
    steps = greedy_layer_sweep(scores, labels, GRID, group_folds(groups, 4), max_layers=2)
    assert steps[0].layers == [4] and len(steps[1].layers) == 2
    assert steps[0].metrics["cv_auroc"] > 0.9
    assert choose_budget(steps, tolerance=0.02).layers == [4]


def test_calibrate_probes_returns_valid_configs_and_thresholds():
    scores, labels, groups = synthetic()
    result = calibrate_probes(
        as_stats(scores),
        labels,
        GRID,
        groups,
        CalibrationSettings(max_layers=2, target_fpr=0.05, folds=3),
    )
    assert result["chosen"] in ("logistic", "mean_focus")
    assert len(result["layer_sweep"]) == 3  # 1 and 2 layers, then all layers
    for kind, probe in result["probes"].items():
        config = ModelProbeConfig(
            model_id="synthetic",
            probe=kind,
            heads=probe["heads"],
            weights=probe["weights"],
            bias=probe["bias"],
            feature=probe.get("feature", "focus"),
            threshold=probe["threshold"],
        )
        assert set(probe["thresholds"]) == {"midpoint", "fpr@0.01", "fpr@0.02", "fpr@0.05"}
        assert config.threshold == pytest.approx(probe["thresholds"]["fpr@0.05"])
        assert config.layers and len(config.layers) <= LAYERS


@pytest.mark.parametrize("budget", ["all", 2])
def test_a_layer_budget_picks_that_step_of_the_sweep(budget):
    # a weak signal on every layer: more layers help, so the choice is visible
    informative = {(layer, 0): 0.04 for layer in range(LAYERS)}
    scores, labels, groups = synthetic(n_groups=80, informative=informative)
    settings = CalibrationSettings(max_layers=2, folds=3, probe="logistic", budget=budget)
    result = calibrate_probes(as_stats(scores), labels, GRID, groups, settings)
    entry = result["layer_sweep"][-1 if budget == "all" else 1]
    chosen = result["probes"]["logistic"]
    assert chosen["heads"] == entry["probe"]["heads"]
    assert chosen["weights"] == entry["probe"]["weights"]
    assert chosen["cv_auroc"] == entry["cv_auroc"]
    if budget == "all":
        assert len({layer for layer, _ in chosen["heads"]}) > 2


def test_a_layer_budget_outside_the_sweep_is_refused():
    scores, labels, groups = synthetic(n_groups=20)
    settings = CalibrationSettings(max_layers=1, folds=3, budget=3)
    with pytest.raises(ValueError, match="layer budget 3 is outside the sweep"):
        calibrate_probes(as_stats(scores), labels, GRID, groups, settings)


def test_retarget_threshold_keeps_the_probe_and_flags_at_most_the_target_share():
    from guardrail.offline.calibration import retarget_threshold

    config = ModelProbeConfig(
        model_id="m", probe="logistic", heads=[(0, 0), (1, 2)], weights=[1.0, -2.0], bias=0.3,
        threshold=0.6,
    )  # fmt: skip
    clean = np.random.default_rng(0).uniform(0.1, 0.95, 400)
    new, info = retarget_threshold(config, clean, 0.02, "mine.jsonl", "abc")
    assert (new.heads, new.weights, new.bias) == (config.heads, config.weights, config.bias)
    assert np.mean(clean <= new.threshold) <= 0.02 < np.mean(clean <= new.threshold + 0.01)
    assert info["flagged_before"] == pytest.approx(np.mean(clean <= 0.6), abs=1e-4)
    assert new.calibration.thresholds["traffic fpr@0.02"] == pytest.approx(new.threshold)
    assert {"traffic fpr@0.01", "traffic fpr@0.05"} <= set(new.calibration.thresholds)
    assert "400 clean rows of mine.jsonl (sha256 abc)" in new.calibration.notes
    assert new.calibration.max_data_tokens is None  # no lengths given, none recorded
    longer, _ = retarget_threshold(new, clean, 0.02, "long.jsonl", "d", max_data_tokens=700)
    shorter, _ = retarget_threshold(longer, clean, 0.02, "short.jsonl", "e", max_data_tokens=90)
    assert longer.calibration.max_data_tokens == shorter.calibration.max_data_tokens == 700
    with pytest.raises(ValueError, match="needs clean rows"):
        retarget_threshold(config, np.array([]), 0.01, "x", "y")


# -- the combined probe (attention and hidden state in one sparse model) ----------------------


def _combined_rows(seed: int = 0):
    from guardrail.offline.combined import fit_combined

    rng = np.random.default_rng(seed)
    n = 240
    y = np.r_[np.zeros(n // 2), np.ones(n // 2)].astype(int)
    stats = rng.uniform(0.05, 0.9, (n, 3, 5))
    stats[y == 1, 1, 0] *= 0.5  # head (0, 1) attends less to the instruction under injection
    hidden = {2: rng.normal(0, 1, (n, 32)), 5: rng.normal(0, 1, (n, 32))}
    hidden[5][y == 1, 7] += 1.5  # one coordinate of layer 5 carries the injection
    groups = [f"g{i // 2}" for i in range(n)]
    heads = [(0, 0), (0, 1), (1, 0)]
    fit = fit_combined(stats, heads, hidden, y, groups, c_grid=(0.03, 0.3), folds=3)
    return fit, stats, heads, hidden, y


def test_a_combined_fit_reads_both_signals_and_its_config_scores_like_the_fit():
    from guardrail.offline.combined import combined_focus
    from guardrail.probe.config import ModelProbeConfig

    fit, stats, heads, hidden, y = _combined_rows()
    assert (0, 1) in fit.heads and any(p.layer == 5 and 7 in p.dims for p in fit.hidden)
    assert fit.cv_auroc > 0.8  # well above chance on these noisy synthetic rows
    config = ModelProbeConfig(model_id="m", hidden_size=32, **fit.probe_fields())
    vectorised = combined_focus(fit, stats, heads, hidden)
    column = {h: j for j, h in enumerate(heads)}
    for i in range(0, len(y), 17):
        terms = {p.layer: p.project(hidden[p.layer][i]) for p in config.hidden}
        head_stats = {h: stats[i, column[h]] for h in config.heads}
        assert config.focus(head_stats, terms) == pytest.approx(vectorised[i], abs=1e-9)


def test_a_combined_fit_with_data_mean_inputs_keeps_their_position():
    """Data-mean streams are fitted as their own columns: a coordinate that carries the
    injection only in the data's mean stream becomes a ``data_mean`` read-out of that layer,
    and the config scores each row like the fit (both positions of one layer summed)."""
    from guardrail.offline.combined import combined_focus, fit_combined
    from guardrail.probe.config import ModelProbeConfig

    _, stats, heads, hidden, y = _combined_rows()
    rng = np.random.default_rng(3)
    means = {5: rng.normal(0, 1, (len(y), 32))}
    means[5][y == 1, 11] += 2.0
    groups = [f"g{i // 2}" for i in range(len(y))]
    fit = fit_combined(
        stats, heads, hidden, y, groups, c_grid=(0.03, 0.3), folds=3, data_mean=means
    )
    by_position = {(p.layer, p.position): p for p in fit.hidden}
    assert 11 in by_position[(5, "data_mean")].dims
    assert 7 in by_position[(5, "last")].dims
    config = ModelProbeConfig(model_id="m", hidden_size=32, **fit.probe_fields())
    vectorised = combined_focus(fit, stats, heads, hidden, means)
    column = {h: j for j, h in enumerate(heads)}
    for i in range(0, len(y), 17):
        terms: dict[int, float] = {}
        for p in config.hidden or []:
            stream = hidden[p.layer][i] if p.position == "last" else means[p.layer][i]
            terms[p.layer] = terms.get(p.layer, 0.0) + p.project(stream)
        head_stats = {h: stats[i, column[h]] for h in config.heads}
        assert config.focus(head_stats, terms) == pytest.approx(vectorised[i], abs=1e-9)


def test_the_worst_source_threshold_holds_on_every_source():
    from guardrail.offline.combined import worst_source_threshold

    rng = np.random.default_rng(1)
    # three sources whose clean scores sit at different levels: one pooled threshold would
    # flag far more than 1 % of the lowest source
    focus = np.r_[rng.uniform(0.6, 1, 300), rng.uniform(0.3, 1, 300), rng.uniform(0.8, 1, 300)]
    sources = ["a"] * 300 + ["b"] * 300 + ["c"] * 300
    labels = np.zeros(900, dtype=int)
    threshold, per_source = worst_source_threshold(focus, labels, sources, 0.01)
    assert threshold == min(per_source.values()) == per_source["b"]
    for name in "abc":
        rows = np.array(sources) == name
        assert np.mean(focus[rows] <= threshold) <= 0.01
