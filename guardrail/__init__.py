"""In-model prompt-injection guardrails for LLM applications served with vLLM.

The probe reads attention inside the serving model during the request's own prefill (Attention
Tracker), so a guarded request costs almost nothing more than an unguarded one.

Example:
    >>> from guardrail import HookedLLM  # doctest: +SKIP
    >>> with HookedLLM(dtype="float32") as llm:  # doctest: +SKIP
    ...     print(llm.generate([("Summarize the email.", "Hi, lunch at noon?")])[0].probe.focus)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from guardrail.config import Calibration, ModelProbeConfig, load_model_config, read_model_config
from guardrail.errors import (
    ConfigError,
    EngineNotGuardableError,
    GuardrailError,
    HeadsDoNotFitModelError,
    ModelConfigNotFoundError,
    ModelUnavailableError,
    PromptInjectionBlocked,
    RequestError,
)
from guardrail.prompts import GuardedPrompt, Message, PreparedPrompt, Segment, prepare_prompt
from guardrail.verdict import Action, FailureMode, PolicyDecision, Verdict

if TYPE_CHECKING:
    from guardrail.engine import GuardedOutput, HookedLLM, ProbeResult

__all__ = [
    "Action",
    "Calibration",
    "ConfigError",
    "EngineNotGuardableError",
    "FailureMode",
    "GuardedOutput",
    "GuardedPrompt",
    "GuardrailError",
    "HeadsDoNotFitModelError",
    "HookedLLM",
    "Message",
    "ModelConfigNotFoundError",
    "ModelProbeConfig",
    "ModelUnavailableError",
    "PolicyDecision",
    "PreparedPrompt",
    "ProbeResult",
    "PromptInjectionBlocked",
    "RequestError",
    "Segment",
    "Verdict",
    "load_model_config",
    "prepare_prompt",
    "read_model_config",
]

_LAZY = {
    "HookedLLM": "guardrail.engine",
    "GuardedOutput": "guardrail.engine",
    "ProbeResult": "guardrail.engine",
}


def __getattr__(name: str) -> Any:
    # The engine module pulls in vLLM only when used: importing the package stays cheap.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'guardrail' has no attribute {name!r}")
