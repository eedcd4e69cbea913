"""A policy at one of the model config's calibrated operating points (``target_fpr``): it
applies the threshold the shipped SmolLM2 config recorded for that rate, in decisions, early
stops, policy files and the exported threshold gauge, and a rate the config did not record is
refused when the policies are loaded, naming the rates it did; a config re-set on one's own
traffic resolves them on that traffic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from guardrail.policies.files import load_policy_text
from prometheus_client import CollectorRegistry

from guardrail.errors import ConfigError
from guardrail.guard.decider import Decider
from guardrail.guard.settings import GuardSettings
from guardrail.metrics import GuardrailMetrics
from guardrail.offline.calibration import retarget_threshold, threshold_at_fpr
from guardrail.policy import (
    ModelThresholds,
    PromptInjectionPolicy,
    Reading,
    decide,
    early_stop,
)
from guardrail.policy.verdict import Action
from guardrail.probe.config import ModelProbeConfig, load_model_config
from guardrail.probe.prompts import Segment

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMBINED = load_model_config(SMOLLM2, "combined")
LOOSER = PromptInjectionPolicy(name="looser", target_fpr=0.02)
DATA = (Segment(text="Summarise.", kind="instruction"), Segment(text="a doc", kind="data"))


def test_the_shipped_configs_record_three_operating_points() -> None:
    for variant in (None, "combined"):
        config = load_model_config(SMOLLM2, variant)
        points = config.operating_points
        assert sorted(points) == [0.01, 0.02, 0.05]
        assert points[0.01] == config.threshold  # the config's own rule is the 1 % point
        assert points[0.01] < points[0.02] < points[0.05]
        assert config.calibration is not None
        assert config.threshold_at(0.05) == config.calibration.thresholds["worst-source fpr@0.05"]


def test_a_policy_at_an_operating_point_decides_at_its_threshold() -> None:
    looser = COMBINED.threshold_at(0.02)
    assert COMBINED.threshold is not None and looser > COMBINED.threshold
    between = (COMBINED.threshold + looser) / 2  # blocked at 2 %, allowed at the default
    reading = Reading(signals={"focus": between}, segments=DATA)
    thresholds = ModelThresholds.of(COMBINED)
    assert (
        decide([LOOSER], reading, request_id="r", model_threshold=thresholds).action is Action.BLOCK
    )
    default = PromptInjectionPolicy()
    assert (
        decide([default], reading, request_id="r", model_threshold=thresholds).action
        is Action.ALLOW
    )
    assert early_stop([LOOSER], thresholds, 1, DATA) == (looser, True)

    decider = Decider(COMBINED, [LOOSER], GuardSettings())
    assert decider.policies[0].effective_threshold(decider.thresholds) == looser
    assert decider.threshold == COMBINED.threshold  # the config's own threshold is unchanged


def test_the_exported_threshold_is_the_operating_point() -> None:
    registry = CollectorRegistry()
    metrics = GuardrailMetrics(registry, model_name="m")
    Decider(COMBINED, [LOOSER], GuardSettings(metrics=metrics, model_name="m")).announce()
    labels = {"model_name": "m", "policy": "looser"}
    assert registry.get_sample_value("guardrail_policy_threshold", labels) == pytest.approx(
        COMBINED.threshold_at(0.02), abs=0
    )


def test_a_rate_the_config_did_not_record_is_refused_when_loaded() -> None:
    with pytest.raises(ConfigError, match=r"target_fpr 0.03.*recorded: 0.01, 0.02, 0.05"):
        Decider(COMBINED, [PromptInjectionPolicy(target_fpr=0.03)])
    bare = ModelProbeConfig(model_id="m", heads=[(0, 0)], threshold=0.4)  # never calibrated
    with pytest.raises(ConfigError, match=r"recorded: none\).*guardrail calibrate"):
        Decider(bare, [LOOSER])
    with pytest.raises(ConfigError, match="recorded: none"):  # a bare number has no points
        LOOSER.effective_threshold(0.4)
    assert PromptInjectionPolicy().effective_threshold(ModelThresholds.of(bare)) == 0.4


def test_a_policies_file_names_an_operating_point(tmp_path: Path) -> None:
    text = '{"policies": [{"name": "looser", "target_fpr": 0.05}, "SUSPICIOUS"]}'
    loaded = load_policy_text(text, ModelThresholds.of(COMBINED))
    assert loaded.default[0].effective_threshold(ModelThresholds.of(COMBINED)) == (
        COMBINED.threshold_at(0.05)
    )
    with pytest.raises(ConfigError, match=r"target_fpr 0\.05"):
        load_policy_text(text, ModelThresholds(0.5))


def test_a_config_re_set_on_own_traffic_resolves_on_that_traffic() -> None:
    """After ``guardrail threshold`` the config's points are its traffic's: the same basis as
    its own threshold, so the default policy and ``target_fpr`` at the traffic's rate agree."""
    clean = np.linspace(0.2, 0.9, 200)  # the focus of 200 clean requests of one's own
    mine, _ = retarget_threshold(COMBINED, clean, 0.02, "my traffic", "ab")
    assert sorted(mine.operating_points) == [0.01, 0.02, 0.05]
    assert mine.threshold_at(0.02) == mine.threshold
    assert mine.threshold_at(0.05) == pytest.approx(
        threshold_at_fpr(clean, np.zeros(200, int), 0.05), abs=1e-6
    )
    assert mine.threshold_at(0.05) != COMBINED.threshold_at(0.05)  # not the pool's any more
