"""Decisions: the ``Action`` a policy takes and the ``Verdict`` recorded with every generation.

A verdict is frozen, JSON-serialisable data: what was decided, by which policies, on which
scores and thresholds, for which request and token spans, and how long the probe took.

Example:
    >>> Action.BLOCK.precedence > Action.FLAG.precedence > Action.ALLOW.precedence
    True
    >>> v = Verdict(request_id="r1", action=Action.ALLOW, scores={"focus": 0.8}, reason="allowed")
    >>> Verdict.model_validate_json(v.model_dump_json()) == v, v.focus
    (True, 0.8)
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from guardrail.protocol import ProbeErrorReason


class Action(StrEnum):
    """What happens to a request. Precedence when several policies disagree: block > retry >
    flag > allow."""

    ALLOW = "allow"
    FLAG = "flag"
    RETRY_WITH_STEERING = "retry_with_steering"
    BLOCK = "block"

    @property
    def precedence(self) -> int:
        return _PRECEDENCE[self]


_PRECEDENCE = {Action.ALLOW: 0, Action.FLAG: 1, Action.RETRY_WITH_STEERING: 2, Action.BLOCK: 3}


class FailureMode(StrEnum):
    """What a policy does when the probe could not score a request."""

    FAIL_CLOSED = "fail_closed"  # block
    FAIL_OPEN = "fail_open"  # allow, and say so in the verdict


class PolicyDecision(BaseModel):
    """One policy's decision on one request.

    ``triggered`` is True when the score was at or below the threshold; ``failure`` is set
    instead when the probe could not score and the policy's failure mode decided.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str
    action: Action
    triggered: bool = False
    signal: str | None = None  # the signal the policy compared (None: a text-only policy)
    score: float | None = None
    threshold: float | None = None
    shadow: bool = False
    failure: FailureMode | None = None
    reason: str


class Attempt(BaseModel):
    """One generation attempt of a request (a retry with steering adds a second)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    focus: float | None
    action: Action
    steered: bool = False
    probe_error: str | None = None
    probe_error_reason: ProbeErrorReason | None = None  # the category of ``probe_error``
    steering: str | None = None  # the steering used, e.g. "vector (adjust_rs, c=1)"
    tokens_steered: int = 0


class Verdict(BaseModel):
    """The full, auditable decision for one request.

    ``action`` is what was enforced (shadow policies never count); ``shadow_action`` is what
    the shadow policies alone would have done. ``failure`` is set when the probe could not
    score and a failure mode decided. ``stopped_early`` is True when the engine ended the
    request right after its prefill (it decoded a single stop token). ``beyond_calibration``
    says why the score is less reliable than the model config's calibration suggests (the
    request's data is longer than any calibration row); ``uncalibrated`` that the model config
    was never calibrated at all, and what to run. Neither changes the action.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_id: str
    action: Action
    decisions: tuple[PolicyDecision, ...] = ()
    scores: dict[str, float] = Field(default_factory=dict)  # signal name -> score (when scored)
    thresholds: dict[str, float] = Field(default_factory=dict)  # policy name -> threshold
    head_scores: dict[str, float] = Field(default_factory=dict)  # "layer:head" -> focus
    probe_error: str | None = None  # why the probe could not score, for people
    probe_error_reason: ProbeErrorReason | None = None  # its category, for code and metrics
    failure: FailureMode | None = None
    shadow_action: Action | None = None
    stopped_early: bool = False
    instruction_spans: tuple[tuple[int, int], ...] = ()
    data_spans: tuple[tuple[int, int], ...] = ()
    num_prompt_tokens: int = 0
    probe_latency_s: float = 0.0
    attempts: tuple[Attempt, ...] = ()
    beyond_calibration: str | None = None
    uncalibrated: str | None = None
    reason: str

    @model_validator(mode="before")
    @classmethod
    def _focus_is_a_score(cls, data: Any) -> Any:
        """``focus=`` (older verdicts, and the serialised property) is the "focus" score."""
        if isinstance(data, dict) and "focus" in data:
            data = dict(data)
            focus = data.pop("focus")
            if focus is not None and "scores" not in data:
                data["scores"] = {"focus": focus}
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def focus(self) -> float | None:
        """The attention probe's focus score (low = injection), None when not scored."""
        return self.scores.get("focus")

    @property
    def blocked(self) -> bool:
        return self.action is Action.BLOCK

    @property
    def flagged(self) -> bool:
        return self.action is Action.FLAG
