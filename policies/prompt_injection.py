"""Ready-made prompt-injection policies and policy sets.

Every policy here takes its threshold from the model config (calibrated per model) unless it
says otherwise, so the same objects work on any model that has a config.

Example:
    >>> from guardrail.policies import BLOCK_INJECTIONS, TIERED
    >>> BLOCK_INJECTIONS.action, [p.name for p in TIERED]
    (<Action.BLOCK: 'block'>, ['block_injections', 'suspicious'])
"""

from __future__ import annotations

from guardrail.policy import DEFAULT_POLICY, PromptInjectionPolicy, RetrySettings
from guardrail.policy.verdict import Action, FailureMode

BLOCK_INJECTIONS = DEFAULT_POLICY
"""Block at the model's threshold; fail-closed (a request the probe could not score is blocked)."""

FLAG_INJECTIONS = PromptInjectionPolicy(name="flag_injections", action=Action.FLAG)
"""Return the text but mark the verdict flagged; fail-closed like every default."""

MONITOR_ONLY = PromptInjectionPolicy(
    name="monitor", action=Action.FLAG, on_probe_error=FailureMode.FAIL_OPEN
)
"""Flag, and let requests through when the probe fails: observe without ever blocking."""

SHADOW_BLOCK = PromptInjectionPolicy(name="shadow_block", shadow=True)
"""What blocking would do, recorded in ``verdict.shadow_action`` and never enforced: trial a
threshold on live traffic before turning it on."""

STRICT_BLOCK = PromptInjectionPolicy(name="strict_block", threshold_offset=0.1)
"""Block up to 0.1 above the model's threshold: more attacks caught, more false positives (e.g.
for an untrusted tenant, passed as a per-request override)."""

SUSPICIOUS = PromptInjectionPolicy(name="suspicious", action=Action.FLAG, threshold_offset=0.05)
"""Flag the band just above the block threshold."""

RETRY_STEERED = PromptInjectionPolicy(
    name="retry_steered",
    action=Action.RETRY_WITH_STEERING,
    retry=RetrySettings(fallback=Action.BLOCK),
)
"""Generate a flagged request once more, steered with the model's shipped vector toward the
original instruction; deliver it if the steered attempt scores clean, else block. Needs an engine
started with ``enforce_eager=True`` (steering hooks do not run in compiled graphs); see
docs/steering.md for what it buys on SmolLM2."""

DEFAULT = (BLOCK_INJECTIONS,)
"""The set ``GuardedLLM`` uses when given no policies."""

TIERED = (BLOCK_INJECTIONS, SUSPICIOUS)
"""Block below the threshold, flag the band up to 0.05 above it."""

TRIAL = (MONITOR_ONLY, SHADOW_BLOCK)
"""Roll-out mode: flag and record what blocking would do; nothing is ever refused."""
