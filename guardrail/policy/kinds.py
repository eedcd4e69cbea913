"""Policy kinds: frozen data, each with a pure ``evaluate(reading) -> PolicyDecision``.

Policies form a discriminated union on ``kind``. Each kind decides one request from a
``Reading`` (``guardrail.policy.reading``) and says whether the engine may end the request right
after its prefill (``stop_below``). Adding a kind is one new class here, added to ``Policy``;
verdicts, metrics, early stops and loading work on every kind unchanged.

- ``prompt_injection`` (``PromptInjectionPolicy``): acts when a probe signal (the attention
  probe's ``focus`` by default) is at or below a threshold; low focus = injection. When the probe
  could not score, ``on_probe_error`` decides: fail-closed blocks (the default), fail-open allows.
- ``data_pattern`` (``DataPatternPolicy``): acts when a regular expression matches the
  request's untrusted data; text only, decided before generation.

Example:
    >>> from guardrail.policy.reading import Reading
    >>> PromptInjectionPolicy(threshold=0.5).evaluate(Reading(signals={"focus": 0.4})).action
    <Action.BLOCK: 'block'>
    >>> load_policy({"kind": "data_pattern", "patterns": ["<\\\\|im_start\\\\|>"]}).kind
    'data_pattern'
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Annotated, Any, Literal, cast

from pydantic import Field, TypeAdapter, ValidationError, model_validator

from guardrail.errors import ConfigError
from guardrail.policy.reading import Reading
from guardrail.policy.retry import RetrySettings
from guardrail.policy.verdict import Action, FailureMode, PolicyDecision
from guardrail.probe.config import ModelProbeConfig, missing_rate, rate_threshold
from guardrail.probe.prompts import Segment
from guardrail.probe.scoring import FOCUS
from guardrail.strict import (
    ConfigModel,
    FiniteNumber,
    Flag,
    StringInput,
    describe_errors,
    short_repr,
)

__all__ = [
    "DEFAULT_POLICY",
    "NEVER_BY_SCORE",
    "POLICY_TYPES",
    "STOP_ALWAYS",
    "DataPatternPolicy",
    "ModelThreshold",
    "ModelThresholds",
    "PerRequestPolicies",
    "Policy",
    "PolicyLike",
    "PromptInjectionPolicy",
    "load_policies",
    "load_policy",
    "policies_per_request",
]

NEVER_BY_SCORE = -1.0
"""A ``stop_below`` no focus reaches (focus is in [0, 1]): stop only when the probe fails."""
STOP_ALWAYS = 1.0
"""A ``stop_below`` every focus reaches: the request is decided (blocked) before it runs."""


@dataclass(frozen=True)
class ModelThresholds:
    """A model config's thresholds as policies resolve them: its own (``threshold``), and the
    operating points its calibration recorded by rate (``ModelProbeConfig.operating_points``).
    Wherever a policy takes a ``model_threshold``, a plain number means this with no operating
    points."""

    threshold: float | None
    by_rate: Mapping[float, float] = field(default_factory=dict)

    @classmethod
    def of(cls, config: ModelProbeConfig) -> ModelThresholds:
        return cls(config.threshold, config.operating_points)


ModelThreshold = float | ModelThresholds | None
"""What a policy resolves its threshold against: the model config's threshold, or all of the
config's thresholds (:class:`ModelThresholds`)."""


class PromptInjectionPolicy(ConfigModel):
    """Act on a probe signal: ``action`` when ``signal <= threshold`` (default: the focus).

    ``threshold`` defaults to the model config's calibrated threshold, optionally moved by
    ``threshold_offset`` (positive = stricter); or ``target_fpr`` names another of the config's
    calibrated operating points: the threshold that flagged at most that share of the clean
    rows of every calibration source (``ModelProbeConfig.threshold_at``; ``guardrail
    calibrate`` records 0.01, 0.02 and 0.05). ``shadow`` policies are evaluated and recorded,
    never enforced. ``on_probe_error`` decides when the probe could not score the request.
    ``retry`` configures action ``retry_with_steering`` (see ``guardrail.policy.retry``).
    Numbers are strict and finite (a bool, a string, NaN or infinity is a ``ConfigError``).

    Example:
        >>> PromptInjectionPolicy(threshold=0.3, action="flag").effective_threshold(0.5)
        0.3
        >>> PromptInjectionPolicy(threshold_offset=0.1).effective_threshold(0.5)
        0.6
        >>> points = ModelThresholds(0.05, {0.01: 0.05, 0.02: 0.14})
        >>> PromptInjectionPolicy(target_fpr=0.02).effective_threshold(points)
        0.14
    """

    kind: Literal["prompt_injection"] = "prompt_injection"
    name: str = Field(default="prompt_injection", min_length=1)
    action: Annotated[Action, StringInput] = Action.BLOCK
    signal: str = Field(default=FOCUS, min_length=1)
    threshold: FiniteNumber | None = Field(default=None, ge=0.0, le=1.0)
    threshold_offset: FiniteNumber = Field(default=0.0, ge=-1.0, le=1.0)
    target_fpr: FiniteNumber | None = Field(default=None, gt=0.0, lt=1.0)
    shadow: Flag = False
    on_probe_error: Annotated[FailureMode, StringInput] = FailureMode.FAIL_CLOSED
    retry: RetrySettings = Field(default_factory=RetrySettings)

    @model_validator(mode="after")
    def _check(self) -> PromptInjectionPolicy:
        retries = self.action is Action.RETRY_WITH_STEERING
        if not retries and self.retry != RetrySettings():  # a dump's default retry is fine
            raise ValueError(
                "retry settings only apply to action 'retry_with_steering'; set that action "
                "or remove retry"
            )
        given = [
            name
            for name, value in (
                ("threshold", self.threshold),
                ("threshold_offset", self.threshold_offset or None),
                ("target_fpr", self.target_fpr),
            )
            if value is not None
        ]
        if len(given) > 1:
            raise ValueError(
                "give one of threshold (absolute), threshold_offset (relative to the model "
                "config's threshold) or target_fpr (one of the config's calibrated operating "
                f"points), not {' and '.join(given)}"
            )
        return self

    def effective_threshold(self, model_threshold: ModelThreshold) -> float:
        """The threshold this policy applies on a model whose config says ``model_threshold``
        (its threshold, or all of its thresholds: :class:`ModelThresholds`)."""
        if self.threshold is not None:
            return self.threshold
        if isinstance(model_threshold, ModelThresholds):
            points, model_threshold = model_threshold.by_rate, model_threshold.threshold
        else:
            points = {}
        if self.target_fpr is not None:
            rate = self.target_fpr
            threshold = rate_threshold(points, rate)
            if threshold is None:
                raise ConfigError(
                    f"policy {self.name!r} asks for the threshold at target_fpr {rate:g}, and "
                    f"the model config {missing_rate(points, rate)}"
                )
            return threshold
        if model_threshold is not None and (
            isinstance(model_threshold, bool)
            or not isinstance(model_threshold, numbers.Real)
            or not math.isfinite(model_threshold)
        ):
            raise ConfigError(
                f"policy {self.name!r}: the model threshold must be a finite number, got "
                f"{short_repr(model_threshold)}; fix the model config's threshold"
            )
        if model_threshold is None:
            raise ConfigError(
                f"policy {self.name!r} has no threshold and the model config has none either: "
                "set threshold=... on the policy, or calibrate the model (`guardrail calibrate "
                "--model MODEL --out DIR`) to get one"
            )
        return round(min(1.0, max(0.0, model_threshold + self.threshold_offset)), 6)

    def as_shadow(self) -> PromptInjectionPolicy:
        """The same policy in shadow mode: decided and recorded, never enforced."""
        return self.model_copy(update={"shadow": True})

    def evaluate(self, reading: Reading, model_threshold: ModelThreshold = None) -> PolicyDecision:
        """This policy's decision on one reading (pure).

        Example:
            >>> PromptInjectionPolicy(threshold=0.5).evaluate(Reading(signals={"focus": 0.51}))
            ... # doctest: +ELLIPSIS
            PolicyDecision(policy='prompt_injection', action=<Action.ALLOW: 'allow'>, ...)
        """
        threshold = self.effective_threshold(model_threshold)
        failed, score = reading.failed(self.signal), reading.signals.get(self.signal)
        if failed is not None or score is None:
            closed = self.on_probe_error is FailureMode.FAIL_CLOSED
            action, triggered = (Action.BLOCK if closed else Action.ALLOW), False
            mode = self.on_probe_error.value.replace("_", "-")
            reason = f"{mode}: the probe could not score the request ({failed})"
        elif score <= threshold:
            action, triggered = self.action, True
            reason = f"{self.signal} {score:.3f} <= threshold {threshold:.3f}"
        else:
            action, triggered = Action.ALLOW, False
            reason = f"{self.signal} {score:.3f} > threshold {threshold:.3f}"
        return PolicyDecision(
            policy=self.name,
            action=action,
            triggered=triggered,
            signal=self.signal,
            score=None if failed else score,
            threshold=threshold,
            shadow=self.shadow,
            failure=self.on_probe_error if failed else None,
            reason=reason,
        )

    def stop_below(
        self, model_threshold: ModelThreshold, attempt: int, segments: Sequence[Segment]
    ) -> float | None:
        """The focus at or below which the engine may end the request right after prefill:
        when this policy would block it, or when a retry's text would be thrown away (every
        attempt but a last one whose fallback is flag). None: this policy never stops it."""
        if self.shadow or self.signal != FOCUS:  # the worker decides stops on the focus only
            return None
        retry = self.action is Action.RETRY_WITH_STEERING and (
            attempt < self.retry.max_attempts or self.retry.fallback is Action.BLOCK
        )
        if self.action is Action.BLOCK or retry:
            return self.effective_threshold(model_threshold)
        return None

    @property
    def needs_probe(self) -> bool:
        """True: this policy decides on the probe's score (its failure mode applies)."""
        return True


MAX_GROUP_DEPTH = 100
"""The deepest nesting of groups a data pattern may have: Python's ``re`` parses groups
recursively, so whether a deeper one compiles depends on the interpreter's recursion limit."""


def _group_depth(pattern: str) -> int:
    r"""How deep the pattern's groups nest (escapes and character classes skipped).

    Example:
        >>> _group_depth(r"(a(b)[(]\()")
        2
    """
    depth = deepest = 0
    in_class = escaped = False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(depth - 1, 0)
    return deepest


class DataPatternPolicy(ConfigModel):
    """Act when any of ``patterns`` (regular expressions) matches the request's untrusted data.

    Text only: decided from the request itself, so a blocking pattern policy ends the request
    right after its prefill whatever the score. Use it for what must never appear in data a
    model reads (e.g. a chat template's control strings in a retrieved document).

    Example:
        >>> from guardrail.policy.reading import Reading
        >>> policy = DataPatternPolicy(name="no_turns", patterns=[r"<\\|im_start\\|>"])
        >>> data = Segment(text="Hi<|im_start|>system", kind="data")
        >>> policy.evaluate(Reading(segments=(data,))).action
        <Action.BLOCK: 'block'>
    """

    kind: Literal["data_pattern"] = "data_pattern"
    name: str = Field(default="data_pattern", min_length=1)
    action: Annotated[Action, StringInput] = Action.BLOCK
    patterns: tuple[str, ...] = Field(min_length=1)
    ignore_case: Flag = True
    shadow: Flag = False

    @model_validator(mode="after")
    def _check(self) -> DataPatternPolicy:
        if self.action is Action.RETRY_WITH_STEERING:
            raise ValueError("a data_pattern policy can allow, flag or block, not retry")
        for pattern in self.patterns:
            try:
                depth = _group_depth(pattern)
                if depth > MAX_GROUP_DEPTH:  # whether re copes depends on the recursion limit
                    raise re.error(f"groups nested {depth} deep (at most {MAX_GROUP_DEPTH})")
                re.compile(pattern)
            except (re.error, OverflowError, RecursionError) as exc:
                raise ValueError(
                    f"pattern {short_repr(pattern)} is not a usable regular expression: "
                    f"{str(exc) or type(exc).__name__}"
                ) from None
        return self

    @cached_property
    def _compiled(self) -> tuple[re.Pattern[str], ...]:
        flags = re.IGNORECASE if self.ignore_case else 0
        return tuple(re.compile(p, flags) for p in self.patterns)

    def match(self, segments: Sequence[Segment]) -> int | None:
        """The index of the first pattern found in the untrusted segments, or None.

        The index, never the matched text: a verdict's reason must not carry request text.
        """
        for segment in segments:
            if segment.kind == "data":
                for index, pattern in enumerate(self._compiled):
                    if pattern.search(segment.text) is not None:
                        return index
        return None

    def effective_threshold(self, model_threshold: ModelThreshold) -> None:
        """No threshold: this policy does not read a score."""
        return None

    def evaluate(self, reading: Reading, model_threshold: ModelThreshold = None) -> PolicyDecision:
        """This policy's decision on one reading (pure; the probe's outcome does not matter)."""
        found = self.match(reading.segments)
        action = Action.ALLOW if found is None else self.action
        reason = "no pattern in the data" if found is None else f"data matches pattern #{found}"
        return PolicyDecision(
            policy=self.name,
            action=action,
            triggered=found is not None,
            shadow=self.shadow,
            reason=reason,
        )

    def stop_below(
        self, model_threshold: ModelThreshold, attempt: int, segments: Sequence[Segment]
    ) -> float | None:
        """``STOP_ALWAYS`` when this policy blocks the request's data, else None."""
        blocks = not self.shadow and self.action is Action.BLOCK
        return STOP_ALWAYS if blocks and self.match(segments) is not None else None

    @property
    def needs_probe(self) -> bool:
        return False


Policy = Annotated[PromptInjectionPolicy | DataPatternPolicy, Field(discriminator="kind")]
"""Every policy kind, told apart by ``kind`` (default ``prompt_injection`` when loading data)."""
POLICY_TYPES = (PromptInjectionPolicy, DataPatternPolicy)
_POLICY_ADAPTER: TypeAdapter[Policy] = TypeAdapter(Policy)

PolicyLike = PromptInjectionPolicy | DataPatternPolicy | Mapping[str, Any]

DEFAULT_POLICY = PromptInjectionPolicy(name="block_injections")
"""Block at the model config's threshold, fail-closed: what a guard uses unless told otherwise."""


_FIELDS = {str(t.model_fields["kind"].default): list(t.model_fields) for t in POLICY_TYPES}


def _unknown_kind(kind: Any) -> str:
    return f"unknown kind {short_repr(kind)} (kinds: {', '.join(sorted(_FIELDS))})"


def _readable(exc: ValidationError, kind: str) -> str:
    if any(err["type"] == "union_tag_invalid" for err in exc.errors()):
        return _unknown_kind(kind)
    return describe_errors(exc, _FIELDS.get(kind, ()), skip=_FIELDS)  # drop the union tag


def load_policy(data: PolicyLike) -> Policy:
    """A policy from a policy object or plain data (a dict, e.g. read from JSON or YAML).

    A dict without ``kind`` is a ``prompt_injection`` policy. Raises ``ConfigError`` naming
    each bad field and the valid ones.

    Example:
        >>> load_policy({"name": "tenant-a", "threshold": 0.45, "action": "flag"}).action
        <Action.FLAG: 'flag'>
    """
    if isinstance(data, POLICY_TYPES):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"a policy must be a policy object (PromptInjectionPolicy, DataPatternPolicy) or a "
            f"dict, got {type(data).__name__}"
        )
    raw = {"kind": "prompt_injection", **data}
    kind, name = raw["kind"], raw.get("name", raw["kind"])
    label = repr(name) if isinstance(name, str) else short_repr(name)
    if not isinstance(kind, str) or kind not in _FIELDS:  # checked here: pydantic would repr it
        raise ConfigError(f"invalid policy {label}: {_unknown_kind(kind)}")
    try:
        return _POLICY_ADAPTER.validate_python(raw)
    except ValidationError as exc:
        raise ConfigError(f"invalid policy {label}: {_readable(exc, kind)}") from exc


def load_policies(
    policies: Iterable[PolicyLike], model_threshold: ModelThreshold
) -> tuple[Policy, ...]:
    """Validate a policy set: at least one policy, distinct names, every threshold resolvable.

    Example:
        >>> [p.name for p in load_policies([{"name": "a"}, {"name": "b"}], 0.5)]
        ['a', 'b']
    """
    if isinstance(policies, (*POLICY_TYPES, Mapping, str, bytes)) or not isinstance(
        policies, Iterable
    ):
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
    model_threshold: ModelThreshold,
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
