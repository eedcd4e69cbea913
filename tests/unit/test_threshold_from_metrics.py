"""``guardrail threshold --from-metrics``: a threshold read off a running guard's score
histogram, scraped over real HTTP, against the same rule applied to the raw scores."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from guardrail.cli import main
from guardrail.errors import ConfigError
from guardrail.metrics.http import start_metrics_server
from guardrail.metrics.recorder import SCORE_BUCKETS, GuardrailMetrics
from guardrail.offline.shadow import score_histogram
from guardrail.probe.config import ModelProbeConfig, read_model_config
from tests.helpers import allow_or_block


def expected_threshold(scores: np.ndarray, target: float) -> float:
    """The largest bucket edge that flags at most ``target`` of the raw scores (0.0: none)."""
    ok = [e for e in SCORE_BUCKETS if np.mean(scores <= e) <= target + 1e-12]
    return max(ok, default=0.0)


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "m.json"
    config = ModelProbeConfig(model_id="m", heads=[(0, 0)], threshold=0.5)
    path.write_text(config.model_dump_json())
    return path


def test_threshold_from_a_guards_scrape_and_a_window_of_it(config_file, tmp_path, capsys):
    rng = np.random.default_rng(3)
    first = rng.beta(6, 2, size=600)  # clean traffic: most focus high
    second = rng.beta(3, 2, size=900)  # later traffic, lower
    registry = CollectorRegistry()
    metrics = GuardrailMetrics(registry, model_name="m")
    with start_metrics_server(0, registry=registry) as server:
        for focus in first:
            metrics.observe_verdict(allow_or_block(float(focus), threshold=0.0), "m")
        for focus in rng.random(50):  # another model's series: not counted
            metrics.observe_verdict(allow_or_block(float(focus), threshold=0.0), "other")
        earlier = tmp_path / "earlier.prom"
        with urllib.request.urlopen(server.url) as response:
            earlier.write_bytes(response.read())
        for focus in second:
            metrics.observe_verdict(allow_or_block(float(focus), threshold=0.0), "m")

        out = tmp_path / "new.json"
        args = ["threshold", "--config", str(config_file), "--out", str(out)]
        assert main([*args, "--from-metrics", server.url, "--target-fpr", "0.05"]) == 0
        new = read_model_config(out)
        both = np.concatenate([first, second])
        assert new.threshold == expected_threshold(both, 0.05) > 0
        assert new.heads == [(0, 0)] and new.calibration is not None
        assert "1500 scored requests" in new.calibration.notes
        printed = capsys.readouterr().out
        assert f"threshold {new.threshold:g} (was 0.5)" in printed

        window = ["--from-metrics", server.url, "--since", str(earlier), "--target-fpr", "0.02"]
        assert main([*args, *window]) == 0
        assert read_model_config(out).threshold == expected_threshold(second, 0.02)

        assert main([*args, "--from-metrics", server.url, "--model-name", "nope"]) == 2
        assert "models with one: 'm', 'other'" in capsys.readouterr().err


def test_too_few_scores_are_said_and_bad_input_is_refused(config_file, tmp_path, capsys):
    scrape = tmp_path / "s.prom"
    scrape.write_text(
        "# TYPE guardrail_probe_score histogram\n"
        'guardrail_probe_score_bucket{model_name="m",signal="focus",le="0.2"} 1.0\n'
        'guardrail_probe_score_bucket{model_name="m",signal="focus",le="+Inf"} 40.0\n'
        'guardrail_probe_score_count{model_name="m",signal="focus"} 40.0\n'
    )
    out = tmp_path / "new.json"
    args = ["threshold", "--config", str(config_file), "--out", str(out)]
    assert main([*args, "--from-metrics", str(scrape), "--target-fpr", "0.05"]) == 0
    assert read_model_config(out).threshold == 0.2
    assert "at least 200 are needed" in capsys.readouterr().out
    assert main([*args, "--from-metrics", str(tmp_path / "missing.prom")]) == 2
    assert "no scrape at" in capsys.readouterr().err
    assert main([*args]) == 2  # neither --data nor --from-metrics
    assert "--data ROWS.jsonl" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="restarted"):
        later = score_histogram(scrape.read_text(), "m")
        later.minus(score_histogram(scrape.read_text().replace("40.0", "80.0"), "m"))
