"""``GuardrailMetrics`` on hand-built verdicts: exact counter and histogram deltas, names, labels.

Every test builds a fresh ``CollectorRegistry``; nothing touches the global one except the test
that checks the default, which unregisters what it added. An absent series reads as None, never
as zero (see ``tests/unit/test_metrics_http.py``: ``sample``, ``delta``).
"""

from __future__ import annotations

import ast
import importlib.metadata
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.utils import floatToGoString

from guardrail.engine.types import GuardedOutput, ProbeResult
from guardrail.guard.decider import Decider, GuardSettings
from guardrail.metrics.recorder import (
    INITIAL_SIGNALS,
    PROBE_DURATION_BUCKETS,
    PROBE_ERROR_REASONS,
    SCORE_BUCKETS,
    GuardrailMetrics,
)
from guardrail.policy.verdict import Action, Attempt, FailureMode, PolicyDecision, Verdict
from guardrail.probe.config import ModelProbeConfig, load_model_config
from guardrail.probe.prompts import PreparedPrompt
from guardrail.protocol import ProbeErrorReason
from tests.helpers import Delta, delta, key

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
ALLOWED_LABELS = {
    "model_name",
    "policy",
    "action",
    "shadow",
    "mode",
    "outcome",
    "reason",
    "signal",
    "version",
    "vllm_version",
}


def decision(
    policy: str,
    action: Action,
    *,
    shadow: bool = False,
    failure: FailureMode | None = None,
    score: float | None = 0.6,
) -> PolicyDecision:
    return PolicyDecision(
        policy=policy,
        action=action,
        score=None if failure else score,
        threshold=0.5,
        shadow=shadow,
        failure=failure,
        reason="test",
    )


def verdict(
    action: Action = Action.ALLOW,
    *,
    focus: float | None = 0.6,
    scores: dict[str, float] | None = None,
    decisions: list[PolicyDecision] | None = None,
    probe_error: str | None = None,
    probe_error_reason: ProbeErrorReason | None = None,
    latency: float = 0.002,
    attempts: int = 1,
    request_id: str = "r1",
) -> Verdict:
    if scores is None:
        scores = {} if focus is None else {"focus": focus}
    return Verdict(
        request_id=request_id,
        action=action,
        scores=scores,
        probe_error=probe_error,
        probe_error_reason=probe_error_reason,
        decisions=tuple(decisions if decisions is not None else [decision("block_low", action)]),
        probe_latency_s=latency,
        reason="test",
        attempts=tuple(Attempt(focus=focus, action=action, steered=i > 0) for i in range(attempts)),
    )


class Reader:
    """Reads samples of one registry; an absent series reads as None, never as zero."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def __call__(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def snapshot(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in self.registry.collect()
            for s in family.samples
            if not s.name.endswith("_created")
        }

    def delta(self, before: dict) -> Delta:
        """From ``before`` to now: series present both times, and series new since then."""
        return delta(before, self.snapshot())


@pytest.fixture()
def metrics() -> GuardrailMetrics:
    return GuardrailMetrics(CollectorRegistry(), model_name=MODEL)


@pytest.fixture()
def read(metrics: GuardrailMetrics) -> Reader:
    return Reader(metrics.registry)


def buckets_at_or_above(name: str, bounds: tuple[float, ...], value: float, **labels: str) -> dict:
    """The ``_bucket`` series one observation of ``value`` moves: every ``le >= value``."""
    return {
        key(name, model_name=MODEL, le=floatToGoString(b), **labels): 1.0
        for b in (*bounds, math.inf)
        if value <= b
    }


def test_reader_tells_absent_from_zero(metrics, read):
    """The reader can fail an assertion: an absent series is None, a zero one is 0.0."""
    assert read("guardrail_requests_total", model_name=MODEL, action="allow") == 0.0
    assert read("guardrail_requests_total", model_name="never-seen", action="allow") is None
    assert read("guardrail_no_such_metric") is None


def test_allowed_request_moves_exactly_its_series(metrics, read):
    before = read.snapshot()
    metrics.observe_verdict(verdict(Action.ALLOW, focus=0.61, latency=0.003), MODEL)
    expected = {
        key("guardrail_requests_total", model_name=MODEL, action="allow"): 1.0,
        key("guardrail_probe_score_count", model_name=MODEL, signal="focus"): 1.0,
        key("guardrail_probe_score_sum", model_name=MODEL, signal="focus"): 0.61,
        key("guardrail_probe_duration_seconds_count", model_name=MODEL): 1.0,
        key("guardrail_probe_duration_seconds_sum", model_name=MODEL): 0.003,
        **buckets_at_or_above("guardrail_probe_score_bucket", SCORE_BUCKETS, 0.61, signal="focus"),
        **buckets_at_or_above(
            "guardrail_probe_duration_seconds_bucket", PROBE_DURATION_BUCKETS, 0.003
        ),
    }
    assert len(expected) == 5 + 6 + 12  # 0.65 .. 1.0 and +Inf; 0.005 .. 10.0 and +Inf
    got = read.delta(before)
    assert got.moved() == pytest.approx(expected)  # series of the model: there at zero before
    # the policy's decision series did not exist (no set_thresholds): it appears with the verdict
    decision_series = key(
        "guardrail_decisions_total",
        model_name=MODEL,
        policy="block_low",
        action="allow",
        shadow="false",
    )
    assert got.new == {decision_series: 1.0}


def test_score_buckets_count_like_the_policy_compares(metrics, read):
    """``le`` is inclusive like ``score <= threshold``: a score on a threshold is in its bucket."""
    for focus in (0.5, 0.49, 0.51, 0.3, 0.95, 0.05, 0.0484):
        metrics.observe_verdict(verdict(focus=focus), MODEL)
    bucket = "guardrail_probe_score_bucket"
    focus_labels = {"model_name": MODEL, "signal": "focus"}
    assert read(bucket, **focus_labels, le="0.5") == 5.0
    assert read(bucket, **focus_labels, le="0.45") == 3.0
    assert read(bucket, **focus_labels, le="0.3") == 3.0
    assert read(bucket, **focus_labels, le="0.275") == 2.0
    assert read(bucket, **focus_labels, le="0.05") == 2.0
    assert read(bucket, **focus_labels, le="0.045") == 0.0
    assert read(bucket, **focus_labels, le="0.0025") == 0.0
    assert read(bucket, **focus_labels, le="+Inf") == 7.0
    assert read(bucket, **focus_labels, le="0.475") is None  # not a bucket any more
    assert read("guardrail_probe_score_sum", **focus_labels) == pytest.approx(2.8484)


def test_every_signal_of_a_verdict_is_observed_under_its_name(metrics, read):
    before = read.snapshot()
    scores = {"focus": 0.4, "hidden_state": 0.02}
    metrics.observe_verdict(verdict(scores=scores, latency=0.003), MODEL)
    got = read.delta(before)
    hidden = {"model_name": MODEL, "signal": "hidden_state"}
    focus = {"model_name": MODEL, "signal": "focus"}
    # "focus" exists at zero from the start; the other signal appears with its first score
    assert got.changed[key("guardrail_probe_score_count", **focus)] == 1.0
    assert got.changed[key("guardrail_probe_score_sum", **focus)] == pytest.approx(0.4)
    assert key("guardrail_probe_score_count", **hidden) not in before
    assert got.new[key("guardrail_probe_score_count", **hidden)] == 1.0
    assert got.new[key("guardrail_probe_score_sum", **hidden)] == pytest.approx(0.02)
    assert got.new[key("guardrail_probe_score_bucket", **hidden, le="0.015")] == 0.0
    assert got.new[key("guardrail_probe_score_bucket", **hidden, le="0.02")] == 1.0
    # the probe's time is observed once per request, not once per signal
    assert got.changed[key("guardrail_probe_duration_seconds_count", model_name=MODEL)] == 1.0


def test_a_non_finite_score_is_left_out_of_the_histogram(metrics, read):
    metrics.observe_verdict(verdict(scores={"focus": 0.4, "hidden_state": math.nan}), MODEL)
    assert read("guardrail_probe_score_count", model_name=MODEL, signal="focus") == 1.0
    assert read("guardrail_probe_score_count", model_name=MODEL, signal="hidden_state") is None
    metrics.observe_verdict(verdict(scores={"focus": math.inf}), MODEL)
    assert read("guardrail_probe_score_count", model_name=MODEL, signal="focus") == 1.0
    assert read("guardrail_probe_score_sum", model_name=MODEL, signal="focus") == pytest.approx(0.4)


def test_score_buckets_are_increasing_and_end_at_one():
    assert all(low < high for low, high in itertools.pairwise(SCORE_BUCKETS))
    assert SCORE_BUCKETS[0] > 0 and SCORE_BUCKETS[-1] == 1.0
    assert 30 <= len(SCORE_BUCKETS) <= 40


def enclosing_bucket(value: float) -> tuple[float, float]:
    """``(lower, upper]`` of the score bucket that counts ``value`` (lower 0 for the first)."""
    for lower, upper in zip((0.0, *SCORE_BUCKETS), SCORE_BUCKETS, strict=True):
        if lower < value <= upper:
            return lower, upper
    raise AssertionError(f"{value} is outside the score buckets")


@pytest.mark.parametrize("variant", [None, "combined"])
def test_score_buckets_resolve_the_shipped_thresholds(variant):
    """The shipped SmolLM2 thresholds (default 0.060, combined 0.048) are on a bucket edge or in
    a bucket <= 0.01 wide (0.048064 lies in (0.045, 0.05])."""
    threshold = load_model_config("HuggingFaceTB/SmolLM2-135M-Instruct", variant).threshold
    assert threshold is not None and 0 < threshold < 1
    lower, upper = enclosing_bucket(threshold)
    assert threshold in SCORE_BUCKETS or upper - lower <= 0.01 + 1e-12, (threshold, lower, upper)


def test_score_buckets_are_narrow_wherever_thresholds_sit():
    """From 0.025 to 0.7 (where thresholds sit) no bucket is wider than 20 % of its upper edge."""
    for upper in SCORE_BUCKETS:
        lower, _ = enclosing_bucket(upper)
        if 0.025 <= upper <= 0.7:
            assert upper - lower <= 0.2 * upper + 1e-12, (lower, upper)


def test_every_policy_decision_is_counted_with_its_shadow_flag(metrics, read):
    decisions = [
        decision("strict", Action.BLOCK),
        decision("watch", Action.FLAG),
        decision("canary", Action.BLOCK, shadow=True),
    ]
    metrics.observe_verdict(verdict(Action.BLOCK, focus=0.2, decisions=decisions), MODEL)
    metrics.observe_verdict(
        verdict(Action.ALLOW, focus=0.9, decisions=[decision("canary", Action.ALLOW, shadow=True)]),
        MODEL,
    )
    count = "guardrail_decisions_total"
    assert read(count, model_name=MODEL, policy="strict", action="block", shadow="false") == 1
    assert read(count, model_name=MODEL, policy="watch", action="flag", shadow="false") == 1
    assert read(count, model_name=MODEL, policy="canary", action="block", shadow="true") == 1
    assert read(count, model_name=MODEL, policy="canary", action="allow", shadow="true") == 1
    assert read("guardrail_requests_total", model_name=MODEL, action="block") == 1
    assert read("guardrail_requests_total", model_name=MODEL, action="allow") == 1
    total = sum(v for (n, _), v in read.snapshot().items() if n == count)
    assert total == 4


def test_probe_error_counts_once_by_reason_and_records_failure_modes(metrics, read):
    before = read.snapshot()
    failed = [
        decision("closed", Action.BLOCK, failure=FailureMode.FAIL_CLOSED),
        decision("open", Action.ALLOW, failure=FailureMode.FAIL_OPEN),
        decision("shadowed", Action.ALLOW, failure=FailureMode.FAIL_OPEN, shadow=True),
    ]
    metrics.observe_verdict(
        verdict(
            Action.BLOCK,
            focus=None,
            decisions=failed,
            latency=0.0,
            probe_error="layer 2: RuntimeError: fault injected",
            probe_error_reason=ProbeErrorReason.LAYER,
        ),
        MODEL,
    )
    got = read.delta(before)
    # no score and no probe duration: the probe did not score this request
    assert got.moved() == {
        key("guardrail_requests_total", model_name=MODEL, action="block"): 1.0,
        key("guardrail_probe_errors_total", model_name=MODEL, reason="layer"): 1.0,
    }
    # the policies' series did not exist before (no set_thresholds): they appear with the verdict
    fail = "guardrail_failure_decisions_total"
    decisions = "guardrail_decisions_total"
    assert got.new == {
        key(fail, model_name=MODEL, policy="closed", mode="fail_closed", shadow="false"): 1.0,
        key(fail, model_name=MODEL, policy="open", mode="fail_open", shadow="false"): 1.0,
        key(fail, model_name=MODEL, policy="shadowed", mode="fail_open", shadow="true"): 1.0,
        key(decisions, model_name=MODEL, policy="closed", action="block", shadow="false"): 1.0,
        key(decisions, model_name=MODEL, policy="open", action="allow", shadow="false"): 1.0,
        key(decisions, model_name=MODEL, policy="shadowed", action="allow", shadow="true"): 1.0,
    }
    assert got.changed[key("guardrail_probe_score_count", model_name=MODEL, signal="focus")] == 0


def test_probe_error_labels_are_the_reasons_and_keep_their_dashboard_names():
    # dashboards and alerts select these values: a new reason is added, none renamed
    assert tuple(r.value for r in ProbeErrorReason) == PROBE_ERROR_REASONS
    assert set(PROBE_ERROR_REASONS) == {
        "plan", "layer", "probe", "aggregate", "missing", "incomplete", "hidden", "engine",
        "other",
    }  # fmt: skip


@pytest.mark.parametrize("reason", list(ProbeErrorReason))
def test_every_probe_error_reason_counts_under_its_own_label(metrics, read, reason):
    errors = "guardrail_probe_errors_total"
    assert read(errors, model_name=MODEL, reason=reason.value) == 0  # exists from the start
    before = read.snapshot()
    failed = verdict(Action.BLOCK, focus=None, latency=0.0, probe_error="x")
    metrics.observe_verdict(failed.model_copy(update={"probe_error_reason": reason}), MODEL)
    moved = {k: v for k, v in read.delta(before).moved().items() if k[0] == errors}
    assert moved == {key(errors, model_name=MODEL, reason=reason.value): 1.0}


def test_a_probe_error_without_a_reason_counts_as_other(metrics, read):
    metrics.observe_verdict(verdict(Action.BLOCK, focus=None, probe_error="layer 2: x"), MODEL)
    assert read("guardrail_probe_errors_total", model_name=MODEL, reason="other") == 1
    assert read("guardrail_probe_errors_total", model_name=MODEL, reason="layer") == 0


@pytest.mark.parametrize(
    "message",
    ["anything", "probe: RuntimeError: reworded", "missing: looks like another reason", "layer x"],
)
def test_the_label_follows_the_probe_result_reason_never_its_message(metrics, read, message):
    config = ModelProbeConfig(model_id="m", heads=[(0, 0)], threshold=0.5)
    decider = Decider(
        config, [{"threshold": 0.5}], GuardSettings(metrics=metrics, model_name=MODEL)
    )
    prompt = PreparedPrompt([1, 2, 3, 4], [(0, 2)], [(2, 4)], "text")
    probe = ProbeResult(None, error=message, error_reason=ProbeErrorReason.LAYER)
    before = read.snapshot()
    output = GuardedOutput(index=0, prompt=prompt, probe=probe)
    result = decider.verdict("r1", output, decider.policies)
    assert result is not None and result.blocked and result.probe_error == message
    assert result.probe_error_reason is ProbeErrorReason.LAYER
    assert result.attempts[0].probe_error_reason is ProbeErrorReason.LAYER
    audit = json.loads(result.model_dump_json())  # the audit record carries the reason
    assert audit["probe_error_reason"] == "layer"
    assert Verdict.model_validate_json(result.model_dump_json()) == result
    metrics.observe_verdict(result, MODEL)
    errors = "guardrail_probe_errors_total"
    moved = {k: v for k, v in read.delta(before).moved().items() if k[0] == errors}
    assert moved == {key(errors, model_name=MODEL, reason="layer"): 1.0}


def test_retried_requests_count_once_with_the_final_outcome(metrics, read):
    metrics.observe_verdict(verdict(Action.ALLOW, attempts=2), MODEL)
    metrics.observe_verdict(verdict(Action.BLOCK, focus=0.1, attempts=3), MODEL)
    metrics.observe_verdict(verdict(Action.BLOCK, focus=0.1, attempts=1), MODEL)
    metrics.observe_verdict(verdict(Action.ALLOW, attempts=0), MODEL)
    retried = "guardrail_retried_requests_total"
    assert read(retried, model_name=MODEL, outcome="allow") == 1
    assert read(retried, model_name=MODEL, outcome="block") == 1
    assert read(retried, model_name=MODEL, outcome="flag") is None  # never retried: no series


def test_requests_beyond_calibration_are_counted(metrics, read):
    name = "guardrail_beyond_calibration_requests_total"
    assert read(name, model_name=MODEL) == 0  # the series exists at zero from the start
    metrics.observe_verdict(verdict(Action.ALLOW), MODEL)
    assert read(name, model_name=MODEL) == 0
    beyond = verdict(Action.ALLOW).model_copy(update={"beyond_calibration": "data has 9 tokens"})
    metrics.observe_verdict(beyond, MODEL)
    assert read(name, model_name=MODEL) == 1


def test_in_flight_goes_up_inside_and_back_down_on_error(metrics, read):
    gauge = "guardrail_requests_in_flight"
    assert read(gauge, model_name="other") is None
    with metrics.track_in_flight(3):
        assert read(gauge, model_name=MODEL) == 3
        with metrics.track_in_flight(model_name="other"):
            assert read(gauge, model_name="other") == 1
        assert read(gauge, model_name="other") == 0
    assert read(gauge, model_name=MODEL) == 0
    with pytest.raises(RuntimeError), metrics.track_in_flight(2):
        assert read(gauge, model_name=MODEL) == 2
        raise RuntimeError("engine failed")
    assert read(gauge, model_name=MODEL) == 0


def test_thresholds_exported_and_policy_series_start_at_zero(metrics, read):
    class FollowsModel:
        name, threshold, shadow = "follows_model", None, False

        def effective_threshold(self, model_threshold: float) -> float:
            return model_threshold + 0.1

    policies = [
        SimpleNamespace(name="strict", threshold=0.45),
        SimpleNamespace(name="canary", threshold=0.6, shadow=True),
        SimpleNamespace(name="unresolved", threshold=None),
        FollowsModel(),
    ]
    metrics.set_thresholds(policies, model_threshold=0.4)
    gauge = "guardrail_policy_threshold"
    assert read(gauge, model_name=MODEL, policy="strict") == 0.45
    assert read(gauge, model_name=MODEL, policy="canary") == 0.6
    assert read(gauge, model_name=MODEL, policy="follows_model") == pytest.approx(0.5)
    assert (
        metrics.registry.get_sample_value(gauge, {"model_name": MODEL, "policy": "unresolved"})
        is None
    )
    fail_open = {"model_name": MODEL, "policy": "canary", "mode": "fail_open", "shadow": "true"}
    assert metrics.registry.get_sample_value("guardrail_failure_decisions_total", fail_open) == 0
    block = {"model_name": MODEL, "policy": "strict", "action": "block", "shadow": "false"}
    assert metrics.registry.get_sample_value("guardrail_decisions_total", block) == 0


def test_fixed_series_of_the_configured_model_exist_before_any_request(metrics):
    registry = metrics.registry
    for action in Action:
        labels = {"model_name": MODEL, "action": action.value}
        assert registry.get_sample_value("guardrail_requests_total", labels) == 0
    for reason in PROBE_ERROR_REASONS:
        labels = {"model_name": MODEL, "reason": reason}
        assert registry.get_sample_value("guardrail_probe_errors_total", labels) == 0
    assert INITIAL_SIGNALS == ("focus",)
    focus = {"model_name": MODEL, "signal": "focus"}
    assert registry.get_sample_value("guardrail_probe_score_count", focus) == 0
    assert registry.get_sample_value("guardrail_probe_score_sum", focus) == 0
    for bound in (*SCORE_BUCKETS, math.inf):
        labels = {**focus, "le": floatToGoString(bound)}
        assert registry.get_sample_value("guardrail_probe_score_bucket", labels) == 0, labels
    other = {"model_name": MODEL, "signal": "hidden_state"}
    assert registry.get_sample_value("guardrail_probe_score_count", other) is None


def test_model_name_defaults_to_the_configured_one_and_separates_series(metrics, read):
    metrics.observe_verdict(verdict())
    metrics.observe_verdict(verdict(), "served-b")
    total = "guardrail_requests_total"
    assert read(total, model_name=MODEL, action="allow") == 1
    assert read(total, model_name="served-b", action="allow") == 1


def test_build_info_names_both_versions(metrics):
    import vllm

    try:
        version = importlib.metadata.version("vllm-guardrail")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    labels = {"version": version, "vllm_version": vllm.__version__}
    assert metrics.registry.get_sample_value("guardrail_build_info", labels) == 1
    assert (
        sum(
            1
            for f in metrics.registry.collect()
            if f.name == "guardrail_build_info"
            for _ in f.samples
        )
        == 1
    )


def test_names_labels_and_no_request_data_in_the_exposition(metrics):
    failing = [decision("closed", Action.BLOCK, failure=FailureMode.FAIL_CLOSED)]
    metrics.observe_verdict(verdict(request_id="req-7f3a9c", attempts=2), MODEL)
    metrics.observe_verdict(
        verdict(
            Action.BLOCK,
            focus=None,
            decisions=failing,
            request_id="req-0000",
            probe_error="probe: secret prompt",
            probe_error_reason=ProbeErrorReason.PROBE,
        )
    )
    metrics.set_thresholds([SimpleNamespace(name="closed", threshold=0.5)])
    metrics.set_calibrated(True)
    with metrics.track_in_flight():
        text = generate_latest(metrics.registry).decode()
    assert "req-7f3a9c" not in text and "req-0000" not in text and "secret" not in text
    families = list(metrics.registry.collect())
    assert len(families) == 12
    for family in families:
        assert family.name.startswith("guardrail_") and "guardrail_guardrail" not in family.name
        assert family.samples, f"{family.name} has no series"
        for sample in family.samples:
            assert set(sample.labels) - {"le"} <= ALLOWED_LABELS, sample
            if family.type == "counter":
                assert sample.name.endswith(("_total", "_created")), sample.name
        if family.name.endswith("_seconds"):
            assert family.type == "histogram"
    assert "guardrail_probe_duration_seconds" in {f.name for f in families}


def guardrail_samples(registry: CollectorRegistry) -> list[tuple[str, dict[str, str]]]:
    return [
        (sample.name, sample.labels)
        for family in registry.collect()
        if family.name.startswith("guardrail_")
        for sample in family.samples
    ]


@pytest.mark.parametrize("explicit", [True, False], ids=["registry=None", "no registry"])
def test_registry_none_registers_nowhere(explicit: bool):
    before = guardrail_samples(REGISTRY)
    metrics = (
        GuardrailMetrics(None, model_name="nowhere-test")
        if explicit
        else GuardrailMetrics(model_name="nowhere-test")
    )
    metrics.observe_verdict(verdict(Action.BLOCK, focus=0.1))

    assert metrics.registry is None
    assert guardrail_samples(REGISTRY) == before  # the global registry gained nothing
    blocked = {"model_name": "nowhere-test", "action": "block"}
    assert REGISTRY.get_sample_value("guardrail_requests_total", blocked) is None
    # the metrics still count, where no scrape sees them
    [requests] = metrics.requests.collect()
    counts = {
        s.labels["action"]: s.value
        for s in requests.samples
        if s.name == "guardrail_requests_total"
    }
    assert (counts["block"], counts["allow"]) == (1, 0)
    # registered nowhere: a second one has no duplicate to collide with, and unregister is a no-op
    GuardrailMetrics(None, model_name="nowhere-test").unregister()
    metrics.unregister()


def test_the_global_registry_is_passed_explicitly():
    metrics = GuardrailMetrics(REGISTRY, model_name="global-test")
    try:
        value = REGISTRY.get_sample_value(
            "guardrail_requests_total", {"model_name": "global-test", "action": "allow"}
        )
        assert value == 0
    finally:
        metrics.unregister()
    assert (
        REGISTRY.get_sample_value(
            "guardrail_requests_total", {"model_name": "global-test", "action": "allow"}
        )
        is None
    )


def test_importing_registers_nothing_and_sets_no_environment():
    code = (
        "import os, prometheus_client as p\n"
        "before = set(p.REGISTRY._names_to_collectors), dict(os.environ)\n"
        "import guardrail.metrics.recorder, guardrail.metrics.http\n"
        "after = set(p.REGISTRY._names_to_collectors), dict(os.environ)\n"
        "assert before == after, (after[0] - before[0])\n"
        "print('ok')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_vllm_worker_code_records_no_metrics():
    """Metrics recorded in a vLLM worker process are never scraped: the worker records none."""
    modules = sorted((ROOT / "guardrail" / "worker").glob("*.py"))
    assert len(modules) > 1, "the worker package moved"
    imported: set[str] = set()
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
    assert "torch" in imported, "the worker modules import torch; parsing failed"
    assert not {m for m in imported if m.startswith(("prometheus_client", "guardrail.metrics"))}
