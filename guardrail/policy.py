"""Policies: frozen data that turns the probe's focus score into an action, and pure functions
that decide.

A policy triggers when ``focus <= threshold`` (low focus = injection). Several policies combine
with a fixed precedence, block > retry > flag > allow; shadow policies decide and are recorded
but never act. When the probe could not score a request each policy's ``on_probe_error`` decides:
fail-closed blocks (the default), fail-open allows; the verdict says which happened.

Example:
    >>> strict = PromptInjectionPolicy(name="strict", threshold=0.4)
    >>> watch = PromptInjectionPolicy(name="watch", threshold=0.6, action="flag")
    >>> decide([strict, watch], Reading(focus=0.5), request_id="r1").action
    <Action.FLAG: 'flag'>
    >>> decide([strict, watch], Reading(focus=0.3), request_id="r1").action
    <Action.BLOCK: 'block'>
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from guardrail.errors import ConfigError
from guardrail.retry import RetrySettings
from guardrail.verdict import Action, Attempt, FailureMode, PolicyDecision, Verdict

NEVER_BY_SCORE = -1.0
"""A ``stop_below`` no focus reaches (focus is in [0, 1]): stop only when the probe fails."""


class PromptInjectionPolicy(BaseModel):
    """Act on the Attention Tracker focus score: ``action`` when ``focus <= threshold``.

    ``threshold`` defaults to the model config's calibrated threshold, optionally moved by
    ``threshold_offset`` (positive = stricter). ``shadow`` policies are evaluated and recorded,
    never enforced. ``on_probe_error`` decides when the probe could not score the request.
    ``retry`` configures action ``retry_with_steering`` (see ``guardrail.retry``).

    Example:
        >>> PromptInjectionPolicy(threshold=0.3, action="flag").effective_threshold(0.5)
        0.3
        >>> PromptInjectionPolicy(threshold_offset=0.1).effective_threshold(0.5)
        0.6
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["prompt_injection"] = "prompt_injection"
    name: str = Field(default="prompt_injection", min_length=1)
    action: Action = Action.BLOCK
    threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    threshold_offset: float = Field(default=0.0, ge=-1.0, le=1.0)
    shadow: bool = False
    on_probe_error: FailureMode = FailureMode.FAIL_CLOSED
    retry: RetrySettings = Field(default_factory=RetrySettings)

    @model_validator(mode="after")
    def _check(self) -> PromptInjectionPolicy:
        if "retry" in self.model_fields_set and self.action is not Action.RETRY_WITH_STEERING:
            raise ValueError(
                "retry settings only apply to action 'retry_with_steering'; set that action "
                "or remove retry"
            )
        if self.threshold is not None and self.threshold_offset:
            raise ValueError(
                "give either threshold (absolute) or threshold_offset (relative to "
                "the model config's threshold), not both"
            )
        return self

    def effective_threshold(self, model_threshold: float | None) -> float:
        """The threshold this policy applies on a model whose config says ``model_threshold``."""
        if self.threshold is not None:
            return self.threshold
        if model_threshold is None:
            raise ConfigError(
                f"policy {self.name!r} has no threshold and the model config has none either: "
                "set threshold=... on the policy, or calibrate the model (`guardrail calibrate "
                "--model MODEL --data pairs.jsonl --out DIR`) to get one"
            )
        return round(min(1.0, max(0.0, model_threshold + self.threshold_offset)), 6)

    def as_shadow(self) -> PromptInjectionPolicy:
        """The same policy in shadow mode: decided and recorded, never enforced."""
        return self.model_copy(update={"shadow": True})


Policy = PromptInjectionPolicy
"""Every policy type (a discriminated union on ``kind`` once there is more than one)."""

PolicyLike = Policy | Mapping[str, Any]

DEFAULT_POLICY = PromptInjectionPolicy(name="block_injections")
"""Block at the model config's threshold, fail-closed: what a guard uses unless told otherwise."""


def _readable(exc: ValidationError, fields: Iterable[str]) -> str:
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "policy"
        if err["type"] == "extra_forbidden":
            problems.append(f"unknown field {where!r} (valid fields: {', '.join(fields)})")
        else:
            problems.append(f"{where}: {err['msg']} (got {err['input']!r})")
    return "; ".join(problems)


def load_policy(data: PolicyLike) -> Policy:
    """A policy from a policy object or plain data (a dict, e.g. read from JSON or YAML).

    Raises ``ConfigError`` naming each bad field and the valid ones.

    Example:
        >>> load_policy({"name": "tenant-a", "threshold": 0.45, "action": "flag"}).action
        <Action.FLAG: 'flag'>
    """
    if isinstance(data, PromptInjectionPolicy):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"a policy must be a PromptInjectionPolicy or a dict, got {type(data).__name__}"
        )
    try:
        return PromptInjectionPolicy.model_validate(dict(data))
    except ValidationError as exc:
        name = data.get("name", "prompt_injection")
        raise ConfigError(
            f"invalid policy {name!r}: {_readable(exc, PromptInjectionPolicy.model_fields)}"
        ) from exc


def load_policies(
    policies: Iterable[PolicyLike], model_threshold: float | None
) -> tuple[Policy, ...]:
    """Validate a policy set: at least one policy, distinct names, every threshold resolvable.

    Example:
        >>> [p.name for p in load_policies([{"name": "a"}, {"name": "b"}], 0.5)]
        ['a', 'b']
    """
    if isinstance(policies, PromptInjectionPolicy | Mapping | str):
        raise ConfigError("policies must be a list of policies; wrap a single one in a list")
    loaded = tuple(load_policy(p) for p in policies)
    if not loaded:
        raise ConfigError(
            "no policies: pass at least one (e.g. guardrail.policies."
            "BLOCK_INJECTIONS); a guard without policies lets everything through"
        )
    names = [p.name for p in loaded]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(
            f"policy names must be distinct (verdicts key decisions by name); "
            f"repeated: {duplicates}"
        )
    for policy in loaded:
        policy.effective_threshold(model_threshold)
    return loaded


PerRequestPolicies = Sequence[PolicyLike] | Sequence[Sequence[PolicyLike] | None] | None
"""A call's policy override: None (the defaults), one list for every request, or one entry per
request (a list, or None for the defaults)."""


def _is_policy_set(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | Mapping)


def policies_per_request(
    policies: PerRequestPolicies,
    n: int,
    defaults: tuple[Policy, ...],
    model_threshold: float | None,
) -> list[tuple[Policy, ...] | ConfigError]:
    """Each of ``n`` requests' policy set; a bad per-request entry is that request's error.

    A malformed argument as a whole (wrong length, not a list) raises ``ConfigError``.

    Example:
        >>> strict = [PromptInjectionPolicy(name="strict", threshold=0.7)]
        >>> sets = policies_per_request([None, strict], 2, (DEFAULT_POLICY,), 0.5)
        >>> [[p.name for p in s] for s in sets]
        [['block_injections'], ['strict']]
    """
    if policies is None:
        return [defaults] * n
    if not _is_policy_set(policies):
        raise ConfigError("policies must be a list of policies, or one list (or None) per request")
    if not policies or not all(p is None or _is_policy_set(p) for p in policies):
        shared = load_policies(cast(Sequence[PolicyLike], policies), model_threshold)
        return [shared] * n
    if len(policies) != n:
        raise ConfigError(f"got {len(policies)} per-request policy lists for {n} requests")
    sets: list[tuple[Policy, ...] | ConfigError] = []
    for entry in cast(Sequence[Sequence[PolicyLike] | None], policies):
        try:
            sets.append(defaults if entry is None else load_policies(entry, model_threshold))
        except ConfigError as exc:
            sets.append(exc)
    return sets


@dataclass(frozen=True)
class Reading:
    """What the probe reported for one request: the input every policy decides on."""

    focus: float | None
    error: str | None = None
    head_scores: Mapping[tuple[int, int], float] = field(default_factory=dict)
    instruction_spans: Sequence[tuple[int, int]] = ()
    data_spans: Sequence[tuple[int, int]] = ()
    num_prompt_tokens: int = 0
    latency_s: float = 0.0
    stopped_early: bool = False

    @property
    def failed(self) -> str | None:
        """Why the probe has no usable score (None when it has one)."""
        if self.error is not None:
            return self.error
        if self.focus is None or not math.isfinite(self.focus):
            return f"no usable score (focus={self.focus})"
        return None


def evaluate(
    policy: Policy, reading: Reading, model_threshold: float | None = None
) -> PolicyDecision:
    """One policy's decision on one reading (pure).

    Example:
        >>> evaluate(PromptInjectionPolicy(threshold=0.5), Reading(focus=0.5)).action
        <Action.BLOCK: 'block'>
        >>> evaluate(PromptInjectionPolicy(threshold=0.5), Reading(focus=0.51)).action
        <Action.ALLOW: 'allow'>
    """
    threshold = policy.effective_threshold(model_threshold)
    failed, focus = reading.failed, reading.focus
    if failed is not None or focus is None:
        closed = policy.on_probe_error is FailureMode.FAIL_CLOSED
        action, triggered = (Action.BLOCK if closed else Action.ALLOW), False
        mode = policy.on_probe_error.value.replace("_", "-")
        reason = f"{mode}: the probe could not score the request ({failed})"
    elif focus <= threshold:
        action, triggered = policy.action, True
        reason = f"focus {focus:.3f} <= threshold {threshold:.3f}"
    else:
        action, triggered = Action.ALLOW, False
        reason = f"focus {focus:.3f} > threshold {threshold:.3f}"
    return PolicyDecision(
        policy=policy.name,
        action=action,
        triggered=triggered,
        score=None if failed else focus,
        threshold=threshold,
        shadow=policy.shadow,
        failure=policy.on_probe_error if failed else None,
        reason=reason,
    )


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
    model_threshold: float | None = None,
) -> Verdict:
    """Every policy's decision, combined into the request's ``Verdict`` (pure).

    Example:
        >>> v = decide([PromptInjectionPolicy(threshold=0.5, shadow=True)], Reading(focus=0.2),
        ...            request_id="r1")
        >>> v.action, v.shadow_action
        (<Action.ALLOW: 'allow'>, <Action.BLOCK: 'block'>)
    """
    decisions = [evaluate(p, reading, model_threshold) for p in policies]
    enforced = [d for d in decisions if not d.shadow]
    shadow = [d for d in decisions if d.shadow]
    action = strictest(enforced)
    focus = reading.focus if reading.failed is None else None
    failure = None
    if reading.failed is not None and enforced:
        failure = FailureMode.FAIL_CLOSED if action is Action.BLOCK else FailureMode.FAIL_OPEN
    return Verdict(
        request_id=request_id,
        action=action,
        decisions=tuple(decisions),
        focus=focus,
        thresholds={d.policy: d.threshold for d in decisions if d.threshold is not None},
        head_scores={f"{layer}:{head}": s for (layer, head), s in reading.head_scores.items()},
        probe_error=reading.failed,
        failure=failure,
        shadow_action=strictest(shadow) if shadow else None,
        stopped_early=reading.stopped_early,
        instruction_spans=tuple(reading.instruction_spans),
        data_spans=tuple(reading.data_spans),
        num_prompt_tokens=reading.num_prompt_tokens,
        probe_latency_s=reading.latency_s,
        attempts=(Attempt(focus=focus, action=action, probe_error=reading.failed),),
        reason=_reason(action, enforced, shadow),
    )


def early_stop(
    policies: Sequence[Policy], model_threshold: float | None = None, attempt: int = 1
) -> tuple[float | None, bool]:
    """``(stop_below, stop_on_probe_error)`` that makes the engine end a request right after
    prefill exactly when the enforced policies would block it, or when its text would be
    thrown away: a ``retry_with_steering`` policy stops generation attempt ``attempt`` (1 = the
    first) unless it is the policy's last one and its fallback is flag (the text is needed).

    The stop threshold is the highest (strictest) threshold among those policies; shadow
    policies never stop anything. With none but a fail-closed policy, the request stops only
    when the probe fails (``NEVER_BY_SCORE``).

    Example:
        >>> early_stop([PromptInjectionPolicy(threshold=0.4),
        ...             PromptInjectionPolicy(name="b", threshold=0.6, on_probe_error="fail_open")])
        (0.6, True)
    """
    enforced = [p for p in policies if not p.shadow]
    blocking = [
        p
        for p in enforced
        if p.action is Action.BLOCK
        or (
            p.action is Action.RETRY_WITH_STEERING
            and (attempt < p.retry.max_attempts or p.retry.fallback is Action.BLOCK)
        )
    ]
    block_at = [p.effective_threshold(model_threshold) for p in blocking]
    on_error = any(p.on_probe_error is FailureMode.FAIL_CLOSED for p in enforced)
    if block_at:
        return max(block_at), on_error
    return (NEVER_BY_SCORE, True) if on_error else (None, False)
