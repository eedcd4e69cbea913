"""Pure decisions: every policy's decision on a reading, combined into the request's ``Verdict``,
and the early stop that lets the engine end a request the policies will block.

Several policies combine with a fixed precedence, block > retry > flag > allow; shadow policies
decide and are recorded but never act.

Example:
    >>> from guardrail.policy.kinds import PromptInjectionPolicy
    >>> strict = PromptInjectionPolicy(name="strict", threshold=0.4)
    >>> watch = PromptInjectionPolicy(name="watch", threshold=0.6, action="flag")
    >>> decide([strict, watch], Reading(signals={"focus": 0.5}), request_id="r1").action
    <Action.FLAG: 'flag'>
    >>> decide([strict, watch], Reading(signals={"focus": 0.3}), request_id="r1").action
    <Action.BLOCK: 'block'>
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from guardrail.policy.kinds import (
    NEVER_BY_SCORE,
    STOP_ALWAYS,
    ModelThreshold,
    Policy,
    PromptInjectionPolicy,
)
from guardrail.policy.reading import Reading
from guardrail.policy.verdict import Action, Attempt, FailureMode, PolicyDecision, Verdict
from guardrail.probe.prompts import Segment
from guardrail.probe.scoring import FOCUS

__all__ = ["decide", "early_stop", "evaluate", "retry_policy", "strictest"]


def evaluate(
    policy: Policy, reading: Reading, model_threshold: ModelThreshold = None
) -> PolicyDecision:
    """One policy's decision on one reading (pure): ``policy.evaluate``.

    Example:
        >>> from guardrail.policy.kinds import PromptInjectionPolicy
        >>> evaluate(PromptInjectionPolicy(threshold=0.5), Reading(signals={"focus": 0.5})).action
        <Action.BLOCK: 'block'>
    """
    return policy.evaluate(reading, model_threshold)


def strictest(decisions: Iterable[PolicyDecision]) -> Action:
    """The action that wins by precedence (block > retry > flag > allow); allow when empty."""
    return max((d.action for d in decisions), key=lambda a: a.precedence, default=Action.ALLOW)


def _reason(action: Action, enforced: list[PolicyDecision], shadow: list[PolicyDecision]) -> str:
    deciding = [d for d in enforced if d.action is action and (d.triggered or d.failure)]
    if deciding:
        text = f"{action.value}: " + "; ".join(f"{d.policy!r} {d.reason}" for d in deciding)
    else:
        text = f"{action.value}: " + "; ".join(f"{d.policy!r} {d.reason}" for d in enforced)
    acting = [d for d in shadow if d.action is not Action.ALLOW]
    if acting:
        text += " | shadow: " + "; ".join(
            f"{d.policy!r} would {d.action.value} ({d.reason})" for d in acting
        )
    return text


def decide(
    policies: Sequence[Policy],
    reading: Reading,
    *,
    request_id: str,
    model_threshold: ModelThreshold = None,
) -> Verdict:
    """Every policy's decision, combined into the request's ``Verdict`` (pure).

    Example:
        >>> from guardrail.policy.kinds import PromptInjectionPolicy
        >>> v = decide([PromptInjectionPolicy(threshold=0.5, shadow=True)],
        ...            Reading(signals={"focus": 0.2}), request_id="r1")
        >>> v.action, v.shadow_action
        (<Action.ALLOW: 'allow'>, <Action.BLOCK: 'block'>)
    """
    decisions = [policy.evaluate(reading, model_threshold) for policy in policies]
    enforced = [d for d in decisions if not d.shadow]
    shadow = [d for d in decisions if d.shadow]
    action = strictest(enforced)
    probe_error, error_reason = reading.failed(), reading.failure_reason()
    failure = None
    if any(d.failure is not None for d in enforced):
        failure = FailureMode.FAIL_CLOSED if action is Action.BLOCK else FailureMode.FAIL_OPEN
    scores = dict(reading.signals) if probe_error is None else {}
    focus = scores.get(FOCUS)
    return Verdict(
        request_id=request_id,
        action=action,
        decisions=tuple(decisions),
        scores=scores,
        thresholds={d.policy: d.threshold for d in decisions if d.threshold is not None},
        head_scores={f"{layer}:{head}": s for (layer, head), s in reading.head_scores.items()},
        probe_error=probe_error,
        probe_error_reason=error_reason,
        failure=failure,
        shadow_action=strictest(shadow) if shadow else None,
        stopped_early=reading.stopped_early,
        instruction_spans=tuple(reading.instruction_spans),
        data_spans=tuple(reading.data_spans),
        num_prompt_tokens=reading.num_prompt_tokens,
        probe_latency_s=reading.latency_s,
        attempts=(
            Attempt(
                focus=focus,
                action=action,
                probe_error=probe_error,
                probe_error_reason=error_reason,
            ),
        ),
        reason=_reason(action, enforced, shadow),
    )


def early_stop(
    policies: Sequence[Policy],
    model_threshold: ModelThreshold = None,
    attempt: int = 1,
    segments: Sequence[Segment] = (),
) -> tuple[float | None, bool]:
    """``(stop_below, stop_on_probe_error)`` that makes the engine end a request right after
    prefill exactly when the enforced policies would block it, or when its text would be
    thrown away (see each kind's ``stop_below``); ``segments`` is the request's content, for
    text policies.

    The stop threshold is the highest (strictest) one among the policies; shadow policies never
    stop anything. With none but a fail-closed policy, the request stops only when the probe
    fails (``NEVER_BY_SCORE``).

    Example:
        >>> from guardrail.policy.kinds import PromptInjectionPolicy
        >>> early_stop([PromptInjectionPolicy(threshold=0.4),
        ...             PromptInjectionPolicy(name="b", threshold=0.6, on_probe_error="fail_open")])
        (0.6, True)
    """
    enforced = [p for p in policies if not p.shadow]
    stops = [p.stop_below(model_threshold, attempt, segments) for p in enforced]
    block_at = [s for s in stops if s is not None]
    on_error = STOP_ALWAYS in block_at or any(
        p.needs_probe and getattr(p, "on_probe_error", None) is FailureMode.FAIL_CLOSED
        for p in enforced
    )
    if block_at:
        return max(block_at), on_error
    return (NEVER_BY_SCORE, True) if on_error else (None, False)


def retry_policy(verdict: Verdict, policies: Sequence[Policy]) -> PromptInjectionPolicy | None:
    """The enforced retry policy behind a ``retry_with_steering`` verdict (the first, in order,
    that triggered), or None when the verdict is not a retry.

    Example:
        >>> retry_policy(Verdict(request_id="r", action="allow", reason=""), [])
    """
    if verdict.action is not Action.RETRY_WITH_STEERING:
        return None
    deciding = {
        d.policy
        for d in verdict.decisions
        if d.action is Action.RETRY_WITH_STEERING and d.triggered and not d.shadow
    }
    retrying = (p for p in policies if isinstance(p, PromptInjectionPolicy))
    return next((p for p in retrying if p.name in deciding), None)
