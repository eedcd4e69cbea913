"""Policies and verdicts as pure data and pure functions: no engine, no model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from pydantic import ValidationError

from guardrail import policies as ready
from guardrail.errors import ConfigError
from guardrail.policy import (
    NEVER_BY_SCORE,
    DataPatternPolicy,
    ProbeErrorReason,
    PromptInjectionPolicy,
    Reading,
    RetrySettings,
    decide,
    early_stop,
    evaluate,
    load_policies,
    load_policy,
    policies_per_request,
    strictest,
)
from guardrail.policy.verdict import Action, FailureMode, Verdict

BLOCK = PromptInjectionPolicy(name="block", threshold=0.4)
FLAG = PromptInjectionPolicy(name="flag", threshold=0.6, action=Action.FLAG)


def at(focus: float | None) -> Reading:
    """A reading whose focus signal is ``focus``."""
    return Reading(signals={"focus": focus} if focus is not None else {})


# -- validation --------------------------------------------------------------------------------
def test_policy_defaults_are_block_fail_closed_at_model_threshold() -> None:
    policy = PromptInjectionPolicy()
    assert (policy.action, policy.on_probe_error, policy.shadow) == (
        Action.BLOCK,
        FailureMode.FAIL_CLOSED,
        False,
    )
    assert policy.effective_threshold(0.37) == 0.37


def test_policy_is_frozen() -> None:
    with pytest.raises(ValidationError, match="frozen"):
        BLOCK.threshold = 0.9  # type: ignore[misc]


@pytest.mark.parametrize("threshold", [-0.01, 1.01, math.inf])
def test_threshold_outside_unit_interval_is_rejected(threshold: float) -> None:
    with pytest.raises(ConfigError, match="threshold"):
        PromptInjectionPolicy(threshold=threshold)


def test_unknown_field_is_rejected_naming_it() -> None:
    with pytest.raises(ConfigError, match="unknown field 'thresh'"):
        PromptInjectionPolicy(thresh=0.3)  # type: ignore[call-arg]


def test_load_policy_gives_readable_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_policy({"name": "tenant-a", "thresh": 0.3, "action": "deny"})
    message = str(info.value)
    assert "invalid policy 'tenant-a'" in message
    assert "unknown field 'thresh'" in message and "valid fields:" in message
    assert "threshold" in message.split("valid fields:")[1]
    assert "action" in message and "'deny'" in message
    assert isinstance(info.value, ValueError)


def test_retry_settings_are_validated() -> None:
    policy = load_policy(
        {"action": "retry_with_steering", "retry": {"vector": "v", "fallback": "flag"}}
    )
    assert policy.retry.fallback is Action.FLAG and policy.retry.max_attempts == 2
    with pytest.raises(ConfigError, match="only apply to action 'retry_with_steering'"):
        PromptInjectionPolicy(action=Action.BLOCK, retry={"vector": "v"})
    for bad in ({"fallback": "allow"}, {"max_attempts": 1}, {"max_attempts": 9}, {"x": 1}):
        with pytest.raises(ConfigError, match="retry"):
            PromptInjectionPolicy(action=Action.RETRY_WITH_STEERING, retry=bad)


def test_threshold_and_offset_are_exclusive() -> None:
    with pytest.raises(ConfigError, match="not threshold and threshold_offset"):
        PromptInjectionPolicy(threshold=0.5, threshold_offset=0.1)
    with pytest.raises(ConfigError, match="not threshold_offset and target_fpr"):
        PromptInjectionPolicy(threshold_offset=0.1, target_fpr=0.02)
    for bad in (0.0, 1.0, -0.1, True, "0.02", float("nan")):
        with pytest.raises(ConfigError, match="target_fpr"):
            PromptInjectionPolicy(target_fpr=bad)


# -- strict, finite numbers and safe loading (issue "Reliability and security", item 5) ----------
_RETRY = {"action": "retry_with_steering"}


@pytest.mark.parametrize(
    ("data", "where", "what"),
    [
        ({"threshold": True}, "threshold = True", "must be a number, not bool"),
        ({"threshold": "0.5"}, "threshold = '0.5'", "must be a number, not str"),
        ({"threshold": math.nan}, "threshold = nan", "must be a finite number"),
        ({"threshold_offset": math.nan}, "threshold_offset = nan", "must be a finite number"),
        ({"threshold_offset": -math.inf}, "threshold_offset = -inf", "must be a finite number"),
        ({"shadow": "false"}, "shadow = 'false'", "write true or false"),
        ({"shadow": 1}, "shadow = 1", "write true or false"),
        ({**_RETRY, "retry": {"coefficient": math.nan}}, "retry.coefficient = nan", "finite"),
        ({**_RETRY, "retry": {"coefficient": True}}, "retry.coefficient = True", "not bool"),
        (
            {**_RETRY, "retry": {"coefficient_growth": math.inf}},
            "coefficient_growth = inf",
            "finite",
        ),
        ({**_RETRY, "retry": {"max_attempts": 3.0}}, "max_attempts = 3.0", "whole number"),
        ({**_RETRY, "retry": {"max_attempts": True}}, "max_attempts = True", "not bool"),
        (
            {"kind": "data_pattern", "patterns": ["x"], "ignore_case": "no"},
            "ignore_case = 'no'",
            "true or false",
        ),
        ({"kind": "data_pattern", "patterns": "abc"}, "patterns = 'abc'", "valid tuple"),
    ],
)
def test_numbers_and_flags_are_strict_in_data_and_in_python(data, where, what) -> None:
    with pytest.raises(ConfigError) as loaded:
        load_policy(data)
    text = str(loaded.value)
    assert text.startswith("invalid policy ") and where in text and what in text
    assert "prompt_injection." not in text and "data_pattern." not in text  # no union tag
    kind = DataPatternPolicy if data.get("kind") == "data_pattern" else PromptInjectionPolicy
    fields = {k: v for k, v in data.items() if k != "kind"}
    with pytest.raises(ConfigError) as built:
        kind(**fields)
    assert where in str(built.value) and isinstance(built.value, ValueError)


def test_nan_retry_coefficient_fails_when_the_policy_is_made_not_at_the_first_retry() -> None:
    """It used to be accepted, then the first retry built ``Steering(coefficient=nan)`` and
    raised a raw pydantic error mid-generation, after the first pass had run."""
    with pytest.raises(ConfigError, match=r"invalid RetrySettings: coefficient = nan"):
        RetrySettings(coefficient=math.nan)
    with pytest.raises(ConfigError, match=r"coefficient 1e\+307 grows to inf by attempt 4"):
        RetrySettings(coefficient=1e307, coefficient_growth=10.0, max_attempts=4)
    assert RetrySettings(coefficient=1e300, coefficient_growth=10.0, max_attempts=4)


@pytest.mark.parametrize("pattern", ["(" * 500 + ")" * 500, "a{99999999999}", "[unclosed", "(?P<x"])
def test_unusable_patterns_are_config_errors(pattern: str) -> None:
    with pytest.raises(ConfigError, match="is not a usable regular expression"):
        load_policy({"kind": "data_pattern", "patterns": [pattern]})


def _deep(levels: int) -> list:
    root: list = []
    node = root
    for _ in range(levels):
        node.append([])
        node = node[0]
    return root


@pytest.mark.parametrize(
    "data",
    [
        {"name": _deep(100_000)},
        {"threshold": _deep(100_000)},
        {"retry": {"vector": _deep(100_000)}, "action": "retry_with_steering"},
        {"kind": _deep(100_000)},
        {"kind": "data_pattern", "patterns": [_deep(100_000)]},
    ],
)
def test_deeply_nested_values_are_config_errors_not_recursion_errors(data) -> None:
    with pytest.raises(ConfigError, match=r"\[\[\[\.\.\.\]\]\]"):
        load_policy(data)


def test_huge_numbers_and_odd_keys_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="threshold = <an integer of 33220 bits>: is too large"):
        load_policy({"threshold": 10**10000})
    with pytest.raises(ConfigError, match="Keys should be strings"):
        load_policy({1: 2})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="wrap a single one"):
        load_policies(5, 0.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="model threshold must be a finite number, got nan"):
        PromptInjectionPolicy().effective_threshold(math.nan)
    assert PromptInjectionPolicy().effective_threshold(np.float32(0.5)) == 0.5  # numbers still work


@pytest.mark.parametrize(
    "data",
    [
        {"name": "a", "threshold": 0.25, "action": "flag", "shadow": True},
        {"threshold_offset": -0.1, "on_probe_error": "fail_open"},
        {**_RETRY, "retry": {"vector": "v", "coefficient": 2, "coefficient_growth": 1.5}},
        {
            "kind": "data_pattern",
            "name": "p",
            "patterns": ["<\\|im_start\\|>"],
            "ignore_case": False,
        },
    ],
)
def test_a_policy_from_data_round_trips(data) -> None:
    policy = load_policy(data)
    assert load_policy(policy.model_dump()) == policy
    assert load_policy(json.loads(policy.model_dump_json())) == policy


def test_offset_moves_and_clamps_the_model_threshold() -> None:
    assert PromptInjectionPolicy(threshold_offset=0.1).effective_threshold(0.5) == 0.6
    assert PromptInjectionPolicy(threshold_offset=0.3).effective_threshold(0.9) == 1.0
    assert PromptInjectionPolicy(threshold_offset=-0.3).effective_threshold(0.1) == 0.0


def test_missing_threshold_everywhere_says_how_to_calibrate() -> None:
    with pytest.raises(ConfigError, match="guardrail calibrate"):
        load_policies([PromptInjectionPolicy()], model_threshold=None)
    assert load_policies([PromptInjectionPolicy(threshold=0.2)], model_threshold=None)


def test_policy_set_needs_policies_and_distinct_names() -> None:
    with pytest.raises(ConfigError, match="no policies"):
        load_policies([], 0.5)
    with pytest.raises(ConfigError, match=r"repeated: \['block'\]"):
        load_policies([BLOCK, BLOCK.model_copy(update={"threshold": 0.1})], 0.5)
    with pytest.raises(ConfigError, match="wrap a single one"):
        load_policies(BLOCK, 0.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="got int"):
        load_policies([3], 0.5)  # type: ignore[list-item]


def test_policies_per_request_isolate_a_bad_entry() -> None:
    defaults = (BLOCK,)
    strict = [PromptInjectionPolicy(name="strict", threshold=0.7)]
    assert policies_per_request(None, 2, defaults, 0.5) == [defaults, defaults]
    assert policies_per_request(strict, 2, defaults, 0.5) == [tuple(strict), tuple(strict)]
    sets = policies_per_request([None, [{"threshold": 2}], strict], 3, defaults, 0.5)
    assert sets[0] == defaults and sets[2] == tuple(strict)
    assert isinstance(sets[1], ConfigError) and "less than or equal to 1" in str(sets[1])
    with pytest.raises(ConfigError, match="2 per-request policy lists for 3 requests"):
        policies_per_request([None, strict], 3, defaults, 0.5)
    with pytest.raises(ConfigError, match="no policies"):
        policies_per_request([], 3, defaults, 0.5)


# -- one policy --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("focus", "expected"), [(0.39, Action.BLOCK), (0.4, Action.BLOCK), (0.41, Action.ALLOW)]
)
def test_policy_triggers_at_or_below_threshold(focus: float, expected: Action) -> None:
    decision = evaluate(BLOCK, at(focus))
    assert decision.action is expected
    assert decision.triggered is (expected is Action.BLOCK)
    assert (decision.score, decision.threshold) == (focus, 0.4)


@pytest.mark.parametrize("action", [Action.ALLOW, Action.FLAG, Action.BLOCK])
def test_triggered_policy_takes_its_action(action: Action) -> None:
    policy = PromptInjectionPolicy(threshold=0.5, action=action)
    assert evaluate(policy, at(0.1)).action is action


@pytest.mark.parametrize(
    "reading",
    [
        Reading(error="layer 2: RuntimeError: boom"),
        at(math.nan),
        Reading(),
    ],
)
def test_probe_failure_is_decided_by_the_failure_mode(reading: Reading) -> None:
    closed = evaluate(FLAG, reading)
    assert (closed.action, closed.failure, closed.score) == (
        Action.BLOCK,
        FailureMode.FAIL_CLOSED,
        None,
    )
    assert "fail-closed" in closed.reason
    opened = evaluate(FLAG.model_copy(update={"on_probe_error": FailureMode.FAIL_OPEN}), reading)
    assert (opened.action, opened.failure) == (Action.ALLOW, FailureMode.FAIL_OPEN)


# -- combining ---------------------------------------------------------------------------------
def test_strictest_precedence_block_over_flag_over_allow() -> None:
    decisions = [evaluate(p, at(0.3)) for p in (FLAG, BLOCK)]
    assert strictest(decisions) is Action.BLOCK
    assert strictest(decisions[:1]) is Action.FLAG
    assert strictest([]) is Action.ALLOW


@pytest.mark.parametrize(
    ("focus", "expected"), [(0.3, Action.BLOCK), (0.5, Action.FLAG), (0.7, Action.ALLOW)]
)
def test_several_policies_combine(focus: float, expected: Action) -> None:
    verdict = decide([FLAG, BLOCK], at(focus), request_id="r")
    assert verdict.action is expected
    assert [d.policy for d in verdict.decisions] == ["flag", "block"]
    assert verdict.thresholds == {"flag": 0.6, "block": 0.4}
    assert verdict.reason.startswith(expected.value)


def test_reason_names_the_deciding_policy() -> None:
    verdict = decide([FLAG, BLOCK], at(0.5), request_id="r")
    assert verdict.reason == "flag: 'flag' focus 0.500 <= threshold 0.600"


def test_shadow_policies_are_recorded_never_enforced() -> None:
    shadow = BLOCK.as_shadow()
    verdict = decide(
        [FLAG.model_copy(update={"threshold": 0.1}), shadow],
        at(0.2),
        request_id="r",
    )
    assert verdict.action is Action.ALLOW
    assert verdict.shadow_action is Action.BLOCK
    assert [d.shadow for d in verdict.decisions] == [False, True]
    assert "shadow: 'block' would block" in verdict.reason
    only_shadow = decide([shadow], at(0.2), request_id="r")
    assert (only_shadow.action, only_shadow.shadow_action) == (Action.ALLOW, Action.BLOCK)


def test_failure_recorded_in_verdict() -> None:
    reading = Reading(
        error="probe: RuntimeError: fault injected for testing",
        error_reason=ProbeErrorReason.LAYER,  # the reason is data: never read off the message
    )
    closed = decide([BLOCK], reading, request_id="r")
    assert (closed.action, closed.failure) == (Action.BLOCK, FailureMode.FAIL_CLOSED)
    assert closed.probe_error == reading.error and closed.focus is None
    assert closed.probe_error_reason is ProbeErrorReason.LAYER
    assert closed.attempts[0].probe_error_reason is ProbeErrorReason.LAYER
    assert json.loads(closed.model_dump_json())["probe_error_reason"] == "layer"
    assert Verdict.model_validate_json(closed.model_dump_json()) == closed
    open_policy = BLOCK.model_copy(update={"on_probe_error": FailureMode.FAIL_OPEN})
    opened = decide([open_policy], reading, request_id="r")
    assert (opened.action, opened.failure) == (Action.ALLOW, FailureMode.FAIL_OPEN)
    assert "fail-open" in opened.reason
    # One fail-closed policy is enough to block.
    assert decide([open_policy, FLAG], reading, request_id="r").action is Action.BLOCK
    # A non-finite score is a failure too, and never reaches the JSON record.
    nan = decide([BLOCK], at(math.nan), request_id="r")
    assert nan.blocked and nan.focus is None and nan.attempts[0].focus is None
    assert nan.probe_error_reason is ProbeErrorReason.OTHER
    assert decide([BLOCK], at(0.9), request_id="r").probe_error_reason is None
    assert Verdict.model_validate_json(nan.model_dump_json()) == nan


def test_verdict_is_frozen_json_round_trip() -> None:
    reading = Reading(
        signals={"focus": 0.25},
        head_scores={(13, 2): 0.2, (14, 7): 0.3},
        instruction_spans=[(3, 9)],
        data_spans=[(12, 40)],
        num_prompt_tokens=44,
        latency_s=0.004,
        stopped_early=True,
    )
    verdict = decide([FLAG, BLOCK.as_shadow()], reading, request_id="abc")
    data = json.loads(verdict.model_dump_json())
    assert data["head_scores"] == {"13:2": 0.2, "14:7": 0.3}
    assert data["data_spans"] == [[12, 40]] and data["action"] == "flag"
    assert (data["request_id"], data["probe_latency_s"], data["stopped_early"]) == (
        "abc",
        0.004,
        True,
    )
    assert Verdict.model_validate_json(verdict.model_dump_json()) == verdict
    with pytest.raises(ValidationError, match="frozen"):
        verdict.action = Action.ALLOW  # type: ignore[misc]


# -- early stop plan ---------------------------------------------------------------------------
def test_early_stop_uses_strictest_enforced_block_threshold() -> None:
    strict = PromptInjectionPolicy(name="strict", threshold=0.55)
    assert early_stop([BLOCK, strict, FLAG]) == (0.55, True)
    assert early_stop([BLOCK, strict.as_shadow()]) == (0.4, True)


def test_early_stop_never_from_shadow_or_flag_policies() -> None:
    fail_open = {"on_probe_error": FailureMode.FAIL_OPEN}
    assert early_stop([BLOCK.as_shadow(), FLAG.model_copy(update=fail_open)]) == (None, False)
    # A fail-closed flag policy still blocks on probe errors: stop on errors, never on score.
    assert early_stop([FLAG]) == (NEVER_BY_SCORE, True)
    assert early_stop([BLOCK.model_copy(update=fail_open)]) == (0.4, False)


@pytest.mark.parametrize("focus", [0.0, 0.2, 0.4, 0.41, 0.6, 1.0])
def test_early_stop_agrees_with_decide(focus: float) -> None:
    """The engine stops a request exactly when the verdict will be block."""
    for policies in ([BLOCK], [FLAG], [FLAG, BLOCK], [BLOCK.as_shadow()]):
        stop_below, _ = early_stop(policies)
        stops = stop_below is not None and focus <= stop_below
        assert stops == decide(policies, at(focus), request_id="r").blocked


def test_early_stop_ends_first_attempts_a_retry_will_replace() -> None:
    """A retry discards attempt 1, so it stops after prefill; the last attempt is stopped only
    when its fallback blocks (a flag fallback returns that attempt's text)."""
    retry = PromptInjectionPolicy(name="retry", threshold=0.5, action=Action.RETRY_WITH_STEERING)
    to_flag = retry.model_copy(update={"retry": RetrySettings(fallback=Action.FLAG)})
    assert early_stop([BLOCK, retry]) == (0.5, True)
    assert early_stop([BLOCK, retry], attempt=2) == (0.5, True)  # fallback block
    assert early_stop([BLOCK, to_flag], attempt=1) == (0.5, True)
    assert early_stop([BLOCK, to_flag], attempt=2) == (0.4, True)
    three = to_flag.model_copy(update={"retry": RetrySettings(max_attempts=3, fallback="flag")})
    assert early_stop([three], attempt=2)[0] == 0.5 and early_stop([three], attempt=3)[0] < 0


# -- ready-made policies -----------------------------------------------------------------------
def test_ready_made_policies_validate_and_export() -> None:
    assert sorted(ready.__all__) == [
        "BLOCK_INJECTIONS",
        "DEFAULT",
        "FLAG_INJECTIONS",
        "FORGED_TURNS",
        "FORGED_TURN_PATTERNS",
        "MONITOR_ONLY",
        "RETRY_STEERED",
        "SHADOW_BLOCK",
        "STRICT_BLOCK",
        "SUSPICIOUS",
        "TIERED",
        "TRIAL",
    ]
    for name in ("DEFAULT", "TIERED", "TRIAL"):
        load_policies(getattr(ready, name), model_threshold=0.5)
    retry = decide([ready.RETRY_STEERED], at(0.1), request_id="r", model_threshold=0.5)
    assert retry.action is Action.RETRY_WITH_STEERING
    assert ready.RETRY_STEERED.retry.fallback is Action.BLOCK
    assert ready.STRICT_BLOCK.effective_threshold(0.5) == 0.6
    assert ready.BLOCK_INJECTIONS.effective_threshold(0.5) == 0.5
    trial = decide(ready.TRIAL, at(0.1), request_id="r", model_threshold=0.5)
    assert (trial.action, trial.shadow_action) == (Action.FLAG, Action.BLOCK)
    tiered = [
        decide(ready.TIERED, at(f), request_id="r", model_threshold=0.5).action
        for f in (0.45, 0.53, 0.6)
    ]
    assert tiered == [Action.BLOCK, Action.FLAG, Action.ALLOW]
