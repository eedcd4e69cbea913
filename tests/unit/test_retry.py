"""The pure side of retry-with-steering: which policy retries, each attempt's steering, and
the final verdict that records every attempt."""

from __future__ import annotations

import math

import pytest

from guardrail.errors import ConfigError
from guardrail.policy import (
    AttemptRecord,
    ProbeErrorReason,
    PromptInjectionPolicy,
    Reading,
    RetrySettings,
    attempt_steering,
    decide,
    final_verdict,
    retry_policy,
)
from guardrail.policy.verdict import Action, Verdict
from guardrail.steering import Steering

RETRY = PromptInjectionPolicy(name="retry", threshold=0.5, action=Action.RETRY_WITH_STEERING)
BLOCK = PromptInjectionPolicy(name="block", threshold=0.2)
STEER = Steering(vector="v", method="adjust_rs", coefficient=1.0)


def _verdict(focus: float, policies=(RETRY, BLOCK)) -> Verdict:
    return decide(list(policies), Reading(signals={"focus": focus}), request_id="r1")


def test_retry_policy_is_the_triggered_enforced_one() -> None:
    assert retry_policy(_verdict(0.3), [RETRY, BLOCK]) is RETRY
    assert retry_policy(_verdict(0.1), [RETRY, BLOCK]) is None  # block wins: no retry
    assert retry_policy(_verdict(0.7), [RETRY, BLOCK]) is None
    shadow = RETRY.as_shadow()
    assert retry_policy(_verdict(0.3, [shadow]), [shadow]) is None


def test_attempt_steering_grows_the_coefficient_per_attempt() -> None:
    plain = RetrySettings(method="add_vector")
    assert attempt_steering(plain, 2, "v", 4.0) == Steering(vector="v", method="add_vector")
    growing = RetrySettings(coefficient_growth=2.0, max_attempts=4)
    coefficients = [attempt_steering(growing, k, "v", 3.0).coefficient for k in (2, 3, 4)]
    assert coefficients == [3.0, 6.0, 12.0]
    with pytest.raises(ValueError, match="retries start at 2"):
        attempt_steering(plain, 1, "v", 1.0)


def test_retry_that_succeeds_returns_the_second_decision_with_both_attempts() -> None:
    first, second = _verdict(0.3), _verdict(0.8)
    verdict = final_verdict(
        [AttemptRecord(first), AttemptRecord(second, STEER, 120)], RetrySettings()
    )
    assert verdict.action is Action.ALLOW and verdict.focus == 0.8
    assert [(a.focus, a.action, a.steered) for a in verdict.attempts] == [
        (0.3, Action.RETRY_WITH_STEERING, False),
        (0.8, Action.ALLOW, True),
    ]
    assert verdict.attempts[1].steering == "v (adjust_rs, c=1)"
    assert verdict.attempts[1].tokens_steered == 120
    assert "attempt 1 (unsteered): focus 0.300 -> retry_with_steering" in verdict.reason
    assert Verdict.model_validate_json(verdict.model_dump_json()) == verdict


@pytest.mark.parametrize("fallback", [Action.BLOCK, Action.FLAG])
def test_retry_still_scored_as_attack_takes_the_fallback(fallback: Action) -> None:
    history = [AttemptRecord(_verdict(0.3)), AttemptRecord(_verdict(0.35), STEER, 80)]
    verdict = final_verdict(history, RetrySettings(fallback=fallback))
    assert verdict.action is fallback
    assert [a.action for a in verdict.attempts] == [Action.RETRY_WITH_STEERING] * 2
    assert "fallback: still scored as an attack" in verdict.reason


def test_failed_steering_takes_the_fallback_and_says_why() -> None:
    history = [AttemptRecord(_verdict(0.3)), AttemptRecord(_verdict(0.9), STEER, 0, "boom")]
    verdict = final_verdict(history, RetrySettings(fallback=Action.FLAG))
    assert verdict.action is Action.FLAG  # the steered text was not steered: never allowed
    assert "FAILED: boom" in str(verdict.attempts[1].steering)
    assert "fallback: steering failed" in verdict.reason
    blocked = [AttemptRecord(_verdict(0.3)), AttemptRecord(_verdict(0.1), STEER, 10, "boom")]
    assert final_verdict(blocked, RetrySettings(fallback=Action.FLAG)).action is Action.BLOCK


def test_each_attempt_keeps_its_probe_error_reason() -> None:
    unscored = Reading(error="lost", error_reason=ProbeErrorReason.MISSING)
    second = decide([RETRY, BLOCK], unscored, request_id="r1")
    history = [AttemptRecord(_verdict(0.3)), AttemptRecord(second, STEER, 5)]
    verdict = final_verdict(history, RetrySettings())
    assert [a.probe_error_reason for a in verdict.attempts] == [None, ProbeErrorReason.MISSING]
    assert verdict.probe_error_reason is ProbeErrorReason.MISSING and verdict.blocked


# -- strict, finite settings (issue "Reliability and security", item 5) ------------------------


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"coefficient": math.nan}, "coefficient = nan"),
        ({"coefficient": math.inf}, "coefficient = inf"),
        ({"coefficient": True}, "coefficient = True"),
        ({"coefficient": "2"}, "coefficient = '2'"),
        ({"coefficient_growth": math.nan}, "coefficient_growth = nan"),
        ({"coefficient_growth": 0}, "coefficient_growth = 0"),
        ({"max_attempts": 2.0}, "max_attempts = 2.0"),
        ({"max_attempts": False}, "max_attempts = False"),
        ({"vector": ""}, "vector = ''"),
    ],
)
def test_bad_settings_fail_at_construction_naming_the_field(fields, where) -> None:
    with pytest.raises(ConfigError) as info:
        RetrySettings(**fields)
    assert str(info.value).startswith(f"invalid RetrySettings: {where}")


def test_every_attempt_of_valid_settings_builds_a_finite_steering() -> None:
    settings = RetrySettings(coefficient=-1e300, coefficient_growth=10.0, max_attempts=4)
    for attempt in (2, 3, 4):
        coefficient = attempt_steering(settings, attempt, "v", 1.0).coefficient
        assert coefficient is not None and math.isfinite(coefficient)


def test_an_overflowing_file_coefficient_is_a_config_error_not_a_pydantic_one() -> None:
    growing = RetrySettings(coefficient_growth=10.0, max_attempts=4)
    with pytest.raises(ConfigError, match="attempt 4: steering coefficient 1e\\+307 x growth 10"):
        attempt_steering(growing, 4, "v", 1e307)
