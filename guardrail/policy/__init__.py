"""Policies: kinds as frozen data (``kinds``), the ``Reading`` they decide on (``reading``), pure
decisions (``decide``), retry settings (``retry``) and the recorded ``Verdict`` (``verdict``).
Nothing here imports an engine.

Example:
    >>> from guardrail.policy import PromptInjectionPolicy, Reading, decide
    >>> decide([PromptInjectionPolicy(threshold=0.5)], Reading(signals={"focus": 0.3}),
    ...        request_id="r1").action
    <Action.BLOCK: 'block'>
"""

from guardrail.policy.decide import decide, early_stop, evaluate, retry_policy, strictest
from guardrail.policy.kinds import (
    DEFAULT_POLICY,
    NEVER_BY_SCORE,
    STOP_ALWAYS,
    DataPatternPolicy,
    ModelThreshold,
    ModelThresholds,
    PerRequestPolicies,
    Policy,
    PolicyLike,
    PromptInjectionPolicy,
    load_policies,
    load_policy,
    policies_per_request,
)
from guardrail.policy.reading import Reading
from guardrail.policy.retry import AttemptRecord, RetrySettings, attempt_steering, final_verdict
from guardrail.policy.verdict import Action, Attempt, FailureMode, PolicyDecision, Verdict
from guardrail.protocol import ProbeErrorReason

__all__ = [
    "DEFAULT_POLICY",
    "NEVER_BY_SCORE",
    "STOP_ALWAYS",
    "Action",
    "Attempt",
    "AttemptRecord",
    "DataPatternPolicy",
    "FailureMode",
    "ModelThreshold",
    "ModelThresholds",
    "PerRequestPolicies",
    "Policy",
    "PolicyDecision",
    "PolicyLike",
    "ProbeErrorReason",
    "PromptInjectionPolicy",
    "Reading",
    "RetrySettings",
    "Verdict",
    "attempt_steering",
    "decide",
    "early_stop",
    "evaluate",
    "final_verdict",
    "load_policies",
    "load_policy",
    "policies_per_request",
    "retry_policy",
    "strictest",
]
