"""``GuardSettings``: how a guard acts on its verdicts, the settings every guard constructor
takes (``GuardedLLM``, ``GuardedLLM.from_engine``, ``AsyncGuardedLLM`` and its ``create``).

Written once here, with their defaults and their checks; the constructors list them by name for
their users, and a unit test holds each list equal to these fields.

Example:
    >>> GuardSettings(on_block="raise").on_block
    'raise'
    >>> GuardSettings(on_block="drop")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    guardrail.errors.ConfigError: on_block must be 'refuse' or 'raise', got 'drop'
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from typing import Any, Literal, Protocol

from guardrail.errors import ConfigError
from guardrail.policy.verdict import Verdict

__all__ = ["DEFAULT_REFUSAL", "GuardSettings", "OnBlock", "VerdictObserver"]

OnBlock = Literal["refuse", "raise"]
DEFAULT_REFUSAL = "I can't help with this request: a prompt-injection guardrail blocked it."


class VerdictObserver(Protocol):
    """What ``GuardedLLM(metrics=...)`` calls; ``guardrail.metrics.recorder.GuardrailMetrics`` fits.

    An observer that also has ``set_thresholds(policies, model_name, model_threshold=...)``
    (``GuardrailMetrics`` does) gets the guard's policies once, when the guard is built, and
    one with ``set_calibrated(calibrated, model_name)`` whether the model config was calibrated.
    """

    def observe_verdict(self, verdict: Verdict, model_name: str) -> None: ...

    def track_in_flight(
        self, n: int, *, model_name: str | None = None
    ) -> AbstractContextManager[Any]: ...


@dataclass(frozen=True)
class GuardSettings:
    """A guard's settings, checked when built.

    ``on_block`` "refuse" answers a blocked request with ``refusal_text``; "raise" raises
    ``PromptInjectionBlocked`` once the call ran. ``metrics`` is an optional observer
    (``VerdictObserver``). ``early_block=False`` generates blocked requests in full and discards
    them afterwards (for comparison only). ``model_name`` labels verdicts in the metrics
    (default: the model config's id).
    """

    on_block: OnBlock = "refuse"
    refusal_text: str = DEFAULT_REFUSAL
    metrics: VerdictObserver | None = None
    early_block: bool = True
    model_name: str | None = None

    def __post_init__(self) -> None:
        if self.on_block not in ("refuse", "raise"):
            raise ConfigError(f"on_block must be 'refuse' or 'raise', got {self.on_block!r}")
        if not isinstance(self.refusal_text, str):
            raise ConfigError("refusal_text must be a string")

    def keywords(self) -> dict[str, Any]:
        """The settings as a guard constructor's keyword arguments (the same names)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
