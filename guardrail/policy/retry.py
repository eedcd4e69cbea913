"""Retry with steering: the settings a policy carries and the pure decisions around a retry.

A policy whose action is ``retry_with_steering`` does not answer a flagged request at once: the
guard generates it again with a steering vector that strengthens adherence to the original
instruction (``guardrail.steering``), re-scores the steered attempt with the same policies and
decides again. Attempts are bounded (``max_attempts``, the first unsteered one included); when
the last attempt still scores as an attack, the policy's ``fallback`` (block or flag) applies.
The final verdict records every attempt.

Example:
    >>> settings = RetrySettings(vector="SmolLM2-135M-Instruct", fallback="flag")
    >>> attempt_steering(settings, attempt=2, vector="SmolLM2-135M-Instruct", vector_coefficient=1)
    Steering(vector='SmolLM2-135M-Instruct', method=None, coefficient=None)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from guardrail.errors import ConfigError
from guardrail.policy.verdict import Action, Attempt, Verdict
from guardrail.steering.math import SteeringMethod
from guardrail.steering.spec import Steering
from guardrail.strict import ConfigModel, FiniteNumber, StringInput, WholeNumber

__all__ = [
    "AttemptRecord",
    "RetrySettings",
    "attempt_steering",
    "final_verdict",
]


class RetrySettings(ConfigModel):
    """How a ``retry_with_steering`` policy retries.

    ``vector``: a loaded or shipped vector name, or a file path (None: the model's shipped
    vector); ``method`` / ``coefficient`` override the vector file's defaults; steered attempt
    k (k >= 2) uses ``coefficient * coefficient_growth ** (k - 2)`` (with greedy decoding an
    identical retry would repeat itself); ``fallback`` applies when no attempt is left.
    Numbers are strict and finite, and the last attempt's coefficient must be finite too: a bad
    value is a ``ConfigError`` when the policy is made, never at the first retry.

    Example:
        >>> RetrySettings(max_attempts=3, coefficient=1.0, coefficient_growth=1.5).fallback
        <Action.BLOCK: 'block'>
    """

    vector: str | None = Field(default=None, min_length=1)
    method: SteeringMethod | None = None
    coefficient: FiniteNumber | None = None
    coefficient_growth: FiniteNumber = Field(default=1.0, gt=0.0, le=10.0)
    max_attempts: WholeNumber = Field(default=2, ge=2, le=4)
    fallback: Annotated[Action, StringInput] = Action.BLOCK

    @field_validator("fallback")
    @classmethod
    def _block_or_flag(cls, value: Action) -> Action:
        if value not in (Action.BLOCK, Action.FLAG):
            raise ValueError(f"fallback must be 'block' or 'flag', got {value.value!r}")
        return value

    @model_validator(mode="after")
    def _last_coefficient_is_finite(self) -> RetrySettings:
        if self.coefficient is not None:
            last = self.coefficient * self.coefficient_growth ** (self.max_attempts - 2)
            if not math.isfinite(last):
                raise ValueError(
                    f"coefficient {self.coefficient:g} grows to {last} by attempt "
                    f"{self.max_attempts} (coefficient_growth {self.coefficient_growth:g}): "
                    "use a smaller coefficient or growth"
                )
        return self


def attempt_steering(
    settings: RetrySettings, attempt: int, vector: str, vector_coefficient: float
) -> Steering:
    """The steering of generation attempt ``attempt`` (2 = the first retry) with the loaded
    vector named ``vector``, whose file's default coefficient is ``vector_coefficient``.

    Example:
        >>> s = RetrySettings(coefficient=2.0, coefficient_growth=1.5)
        >>> attempt_steering(s, attempt=3, vector="v", vector_coefficient=1.0).coefficient
        3.0
    """
    if attempt < 2:
        raise ValueError("attempt 1 is the unsteered generation; retries start at 2")
    coefficient = settings.coefficient
    if settings.coefficient_growth != 1.0:
        base = vector_coefficient if coefficient is None else coefficient
        coefficient = base * settings.coefficient_growth ** (attempt - 2)
        if not math.isfinite(coefficient):
            raise ConfigError(
                f"retry attempt {attempt}: steering coefficient {base:g} x growth "
                f"{settings.coefficient_growth:g}^{attempt - 2} is not finite; use a smaller "
                "coefficient (policy retry.coefficient or the vector file's) or growth"
            )
    return Steering(vector=vector, method=settings.method, coefficient=coefficient)


@dataclass(frozen=True)
class AttemptRecord:
    """One generation attempt as the guard saw it."""

    verdict: Verdict
    steering: Steering | None = None  # None for the first, unsteered attempt
    tokens_steered: int = 0
    steering_error: str | None = None


def describe(steering: Steering | None, error: str | None = None) -> str | None:
    """A short label for an attempt's steering, e.g. ``"v (adjust_rs, c=1.5)"``."""
    if steering is None:
        return None
    method = steering.method or "file method"
    coefficient = "file default" if steering.coefficient is None else f"{steering.coefficient:g}"
    label = f"{steering.vector} ({method}, c={coefficient})"
    return label if error is None else f"{label} FAILED: {error}"


def final_verdict(attempts: Sequence[AttemptRecord], settings: RetrySettings) -> Verdict:
    """The verdict of a retried request: the last attempt's, with every attempt recorded, and
    the fallback applied when the last attempt still says retry or its steering failed.

    Example:
        >>> first = Verdict(request_id="r", action="retry_with_steering", focus=0.2, reason="x")
        >>> second = first.model_copy(update={"scores": {"focus": 0.25}})
        >>> v = final_verdict([AttemptRecord(first), AttemptRecord(second, Steering(vector="v"))],
        ...                   RetrySettings())
        >>> v.action, [a.steered for a in v.attempts]
        (<Action.BLOCK: 'block'>, [False, True])
    """
    last = attempts[-1]
    failed = last.steering_error is not None
    action = last.verdict.action
    if action is Action.RETRY_WITH_STEERING or (failed and action is not Action.BLOCK):
        action = settings.fallback
    records = tuple(
        Attempt(
            focus=a.verdict.focus,
            action=a.verdict.action,
            steered=a.steering is not None,
            probe_error=a.verdict.probe_error,
            probe_error_reason=a.verdict.probe_error_reason,
            steering=describe(a.steering, a.steering_error),
            tokens_steered=a.tokens_steered,
        )
        for a in attempts
    )
    steps = "; ".join(
        f"attempt {i} ({a.steering or 'unsteered'}): focus "
        f"{'n/a' if a.focus is None else f'{a.focus:.3f}'} -> {a.action.value}"
        for i, a in enumerate(records, 1)
    )
    why = ""
    if action is not last.verdict.action:
        why = " (fallback: steering failed)" if failed else " (fallback: still scored as an attack)"
    return last.verdict.model_copy(
        update={"action": action, "attempts": records, "reason": f"{action.value}{why}: {steps}"}
    )
