"""In-model prompt-injection guardrails for LLM applications served with vLLM.

The probe reads attention inside the serving model during the request's own prefill (Attention
Tracker): no second model and no extra forward pass.

Importing the package imports neither torch nor vLLM: the names that need them are imported when
first used, so ``guardrail-serve --help`` answers at once.

Example:
    >>> from guardrail import HookedLLM  # doctest: +SKIP
    >>> with HookedLLM() as llm:  # doctest: +SKIP
    ...     print(llm.generate([("Summarize the email.", "Hi, lunch at noon?")])[0].probe.focus)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from guardrail.errors import (
    ConfigError,
    EngineClosedError,
    EngineDeadError,
    EngineNotGuardableError,
    GuardrailError,
    HeadsDoNotFitModelError,
    ModelConfigNotFoundError,
    ModelUnavailableError,
    PromptInjectionBlocked,
    RequestError,
)
from guardrail.protocol import ProbeErrorReason
from guardrail.version import __version__

if TYPE_CHECKING:
    from guardrail.engine import GuardedOutput, HookedLLM, ProbeResult
    from guardrail.guard.guarded import GuardedLLM, GuardedResult
    from guardrail.metrics.recorder import GuardrailMetrics
    from guardrail.policy import DataPatternPolicy, PromptInjectionPolicy, Reading, load_policy
    from guardrail.policy.verdict import Action, FailureMode, PolicyDecision, Verdict
    from guardrail.probe.config import (
        Calibration,
        ModelProbeConfig,
        load_model_config,
        read_model_config,
    )
    from guardrail.probe.prompts import (
        GuardedPrompt,
        Message,
        PreparedPrompt,
        Segment,
        prepare_prompt,
    )

__all__ = [
    "Action",
    "Calibration",
    "ConfigError",
    "DataPatternPolicy",
    "EngineClosedError",
    "EngineDeadError",
    "EngineNotGuardableError",
    "FailureMode",
    "GuardedLLM",
    "GuardedOutput",
    "GuardedPrompt",
    "GuardedResult",
    "GuardrailError",
    "GuardrailMetrics",
    "HeadsDoNotFitModelError",
    "HookedLLM",
    "Message",
    "ModelConfigNotFoundError",
    "ModelProbeConfig",
    "ModelUnavailableError",
    "PolicyDecision",
    "PreparedPrompt",
    "ProbeErrorReason",
    "ProbeResult",
    "PromptInjectionBlocked",
    "PromptInjectionPolicy",
    "Reading",
    "RequestError",
    "Segment",
    "Verdict",
    "__version__",
    "load_model_config",
    "load_policy",
    "prepare_prompt",
    "read_model_config",
]

_LAZY = {
    "HookedLLM": "guardrail.engine",
    "GuardedOutput": "guardrail.engine",
    "ProbeResult": "guardrail.engine",
    "GuardedLLM": "guardrail.guard",
    "GuardedResult": "guardrail.guard",
    "DataPatternPolicy": "guardrail.policy",
    "PromptInjectionPolicy": "guardrail.policy",
    "Reading": "guardrail.policy",
    "load_policy": "guardrail.policy",
    "GuardrailMetrics": "guardrail.metrics",
    # the probe's score math imports torch
    "Action": "guardrail.policy.verdict",
    "FailureMode": "guardrail.policy.verdict",
    "PolicyDecision": "guardrail.policy.verdict",
    "Verdict": "guardrail.policy.verdict",
    "Calibration": "guardrail.probe.config",
    "ModelProbeConfig": "guardrail.probe.config",
    "load_model_config": "guardrail.probe.config",
    "read_model_config": "guardrail.probe.config",
    "GuardedPrompt": "guardrail.probe.prompts",
    "Message": "guardrail.probe.prompts",
    "PreparedPrompt": "guardrail.probe.prompts",
    "Segment": "guardrail.probe.prompts",
    "prepare_prompt": "guardrail.probe.prompts",
}


def __getattr__(name: str) -> Any:
    # torch and vLLM are imported with the first name that needs them, then the name is kept
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'guardrail' has no attribute {name!r}")
