"""Decisions: the ``Action`` a policy takes and the ``Verdict`` recorded with every generation.

A verdict is frozen, JSON-serialisable data: what was decided, by which policies, on which
scores and thresholds, for which request and token spans, and how long the probe took.

Example:
    >>> Action.BLOCK.precedence > Action.FLAG.precedence > Action.ALLOW.precedence
    True
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field


class Action(str, Enum):
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


class FailureMode(str, Enum):
    """What a policy does when the probe could not score a request."""

    FAIL_CLOSED = "fail_closed"  # block
    FAIL_OPEN = "fail_open"  # allow, and say so in the verdict


class PolicyDecision(BaseModel):
    """One policy's decision on one request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str
    action: Action
    score: float | None = None
    threshold: float | None = None
    shadow: bool = False
    failure: FailureMode | None = None  # set when the probe failed and the failure mode decided
    reason: str


class Attempt(BaseModel):
    """One generation attempt of a request (a retry with steering adds a second)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    focus: float | None
    action: Action
    steered: bool = False
    probe_error: str | None = None


class Verdict(BaseModel):
    """The full, auditable decision for one request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_id: str
    action: Action
    decisions: list[PolicyDecision]
    focus: float | None
    head_scores: dict[str, float] = Field(default_factory=dict)  # "layer:head" -> focus
    probe_error: str | None = None
    instruction_spans: list[tuple[int, int]] = Field(default_factory=list)
    data_spans: list[tuple[int, int]] = Field(default_factory=list)
    num_prompt_tokens: int = 0
    probe_latency_s: float = 0.0
    attempts: list[Attempt] = Field(default_factory=list)
    reason: str

    @property
    def blocked(self) -> bool:
        return self.action is Action.BLOCK

    @property
    def flagged(self) -> bool:
        return self.action is Action.FLAG
