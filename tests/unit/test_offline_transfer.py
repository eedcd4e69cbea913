"""The pool recipe offline, on synthetic scores (no model): the written configs score every row
as the fit does, thresholds are the worst source's, no test row reaches a fit, and writing the
same result twice gives the same bytes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from guardrail.errors import ConfigError
from guardrail.offline.datasets import LabelledPair, ScoreTable
from guardrail.offline.pool_fit import ModelShape, calibrate_on_pool
from guardrail.offline.pool_report import write_pool_calibration
from guardrail.offline.row_scores import config_focus
from guardrail.offline.transfer import ScoredPool, TransferRecipe, measure, probe_focus
from guardrail.offline.transfer_eval import evaluate_transfer, summary
from guardrail.probe.config import read_model_config

pytest.importorskip("sklearn")

HEADS = [(layer, head) for layer in range(3) for head in range(2)]
SHAPE = ModelShape("t/synthetic", num_layers=3, num_heads=2, num_kv_heads=1, hidden_size=8)
RECIPE = TransferRecipe(attention_layers=None, hidden_candidates=(1, 2), max_attention_layers=2)


def synthetic_pool(seed: int = 0) -> ScoredPool:
    """Four calibration sources and one test set, two layouts, 40 groups each; injections move
    head (1, 0)'s stats, stream coordinate 3 of layer 1 and the data mean of layer 1."""
    rng = np.random.default_rng(seed)
    rows = []
    for source in ("a", "b", "c", "d", "test"):
        for g in range(40):
            for label in (0, 1):
                layout = ("pair", "tool")[g % 2]
                extra = {"corpus": source, "layout": layout}
                if source == "test":
                    extra["role"] = "test"
                rid = f"{source}:{g}:{label}"
                rows.append(
                    LabelledPair(rid, "Q", f"d{rid}", label, group=f"{source}:{g}", extra=extra)
                )
    labels = np.array([r.label for r in rows])
    n = len(rows)
    values = rng.uniform(0.2, 0.8, (n, len(HEADS), 5))
    values[labels == 1, 2, 0] -= 0.25
    hidden = {layer: rng.normal(0, 1, (n, 8)).astype(np.float32) for layer in (1, 2)}
    hidden[1][labels == 1, 3] += 1.5
    means = {layer: rng.normal(0, 1, (n, 8)).astype(np.float32) for layer in (1, 2)}
    means[1][labels == 1, 5] += 1.0
    table = ScoreTable(
        "m",
        HEADS,
        [r.id for r in rows],
        values,
        np.full(n, 50),
        np.arange(n) % 17 + 3,
        hidden=hidden,
        data_mean=means,
    )
    return ScoredPool(rows, table)


def test_configs_score_rows_as_the_fit_and_hold_their_provenance():
    pool = synthetic_pool()
    result = calibrate_on_pool(pool, SHAPE, "synthetic rows", RECIPE)
    calibration = pool.calibration
    assert len(calibration) == 4 * 80 and all(p.rows == 320 for p in result.probes.values())
    combined = result.configs["combined"]
    assert result.probes["combined"].data_mean_layers == result.probes["combined"].last_layers[:1]
    assert combined.hidden and not result.configs["attention"].hidden
    for kind, config in result.configs.items():
        probe = result.probes[kind]
        served = config_focus(config, pool.table)
        fitted = probe_focus(pool, probe, np.arange(len(pool.rows)))
        np.testing.assert_allclose(served, fitted, atol=1e-9)
        cal = config.calibration
        assert cal is not None and cal.num_examples == 320 and cal.dataset.startswith("320 rows")
        per_source = {k: v for k, v in cal.thresholds.items() if not k.startswith("worst")}
        assert set(per_source) == {"a fpr@0.01", "b fpr@0.01", "c fpr@0.01", "d fpr@0.01"}
        assert config.threshold == min(per_source.values())
        assert cal.max_data_tokens == int(pool.table.data_tokens[calibration].max())
    assert set(result.left_out) == {"a", "b", "c", "d"}
    assert result.left_out["a"]["combined"].measured["all"]["n_clean"] == 40
    assert set(result.out_of_fold["combined"]["b"]) == {"all", "pair", "tool"}


def test_writing_the_same_result_twice_gives_the_same_bytes(tmp_path):
    pool = synthetic_pool()
    written = []
    for out in (tmp_path / "one", tmp_path / "two"):
        result = calibrate_on_pool(pool, SHAPE, "synthetic rows", RECIPE)
        written.append(write_pool_calibration(result, out, "synthetic"))
    names = [p.name for p in written[0]]
    assert names[:2] == ["synthetic.json", "synthetic.combined.json"]
    for first, second in zip(*written, strict=True):
        assert first.read_bytes() == second.read_bytes(), first.name
    assert read_model_config(written[0][1]).hidden


def test_operating_points_flag_at_most_their_rate_and_are_written(tmp_path):
    """Each recorded rate's threshold flags at most that share of every source's clean rows
    (out of fold), each source left out is measured at its own fit's threshold, and the config
    and the report carry them."""
    pool = synthetic_pool()
    result = calibrate_on_pool(pool, SHAPE, "synthetic rows", RECIPE)
    index = pool.calibration
    sources, labels = pool.corpus[index], pool.labels[index]
    for kind, config in result.configs.items():
        probe, points = result.probes[kind], result.operating_points[kind]
        assert [p["rate"] for p in points] == [0.01, 0.02, 0.05]
        assert config.threshold_at(0.01) == config.threshold
        assert config.operating_points == {p["rate"]: p["threshold"] for p in points}
        thresholds = [p["threshold"] for p in points]
        assert thresholds == sorted(thresholds)  # a looser rate never flags less
        for point in points:
            t = point["threshold"]
            flagged = [
                float((probe.fit.oof_focus[(sources == s) & (labels == 0)] <= t).mean())
                for s in "abcd"
            ]
            assert max(flagged) <= point["rate"] + 1e-12
            assert point["pool"]["flagged_clean_worst"] == round(max(flagged), 4)
            caught = probe.fit.oof_focus[labels == 1] <= t
            assert point["pool"]["caught"] == round(float(caught.mean()), 4)
            unseen = [left[kind] for left in result.left_out.values()]
            at = [left.operating[point["rate"]] for left in unseen]
            shares = [
                float((u.focus[u.labels == 0] <= a).mean()) for u, a in zip(unseen, at, strict=True)
            ]
            assert point["left_out"] is not None
            assert point["left_out"]["flagged_clean_worst"] == round(max(shares), 4)
        for left in result.left_out.values():  # the recipe's own rate is the fit's threshold
            measured = measure(left[kind].labels, left[kind].focus, left[kind].operating[0.01])
            assert measured == left[kind].measured["all"]
        with pytest.raises(ConfigError, match=r"no threshold at rate 0.03 \(recorded: 0.01, 0.02"):
            config.threshold_at(0.03)
    write_pool_calibration(result, tmp_path, "synthetic")
    written = read_model_config(tmp_path / "synthetic.combined.json")
    assert written.operating_points == result.configs["combined"].operating_points
    report = json.loads((tmp_path / "synthetic.report.json").read_text())
    assert report["operating_points"]["combined"][1]["rate"] == 0.02
    markdown = (tmp_path / "synthetic.report.md").read_text()
    assert "## Operating points" in markdown and "combined, at most 2% per source" in markdown


def test_the_transfer_evaluation_never_fits_a_test_row():
    pool = synthetic_pool(1)
    fixed = calibrate_on_pool(pool, SHAPE, "synthetic rows", RECIPE).configs["attention"]
    result = evaluate_transfer(
        pool, RECIPE, ("attention", "combined"), (1,), (1,), (1,), {"fixed": fixed}
    )
    assert all(k.fit is None or k.fit.rows == 320 for k in result.kinds.values())
    table = summary(result)
    assert set(table) == {"fixed", "attention", "combined"}
    assert set(table["combined"]) == {
        "test",
        "a left out",
        "b left out",
        "c left out",
        "d left out",
    }
    assert table["combined"]["test"]["n_injected"] == 40
    assert table["combined"]["test"]["auroc"] > 0.75  # the signal carries to rows never fitted


def test_calibrate_refuses_a_report_among_the_shipped_configs(tmp_path, capsys):
    """Every JSON file in model_configs/ is read as a config: a report there would break them,
    so the command refuses before scoring anything."""
    import json
    from importlib.resources import files

    from guardrail.cli import main

    model = tmp_path / "m"
    model.mkdir()
    sizes = {"num_hidden_layers": 3, "num_attention_heads": 2, "hidden_size": 8}
    (model / "config.json").write_text(json.dumps(sizes))
    shipped = str(files("guardrail.model_configs"))
    assert main(["calibrate", "--model", str(model), "--out", shipped]) == 2
    assert "pass --report elsewhere" in capsys.readouterr().err
