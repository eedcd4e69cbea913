"""The public names are pinned: adding or removing one is a deliberate change."""

from __future__ import annotations

import guardrail

EXPECTED = {
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
    "load_model_config",
    "load_policy",
    "prepare_prompt",
    "read_model_config",
    "__version__",
}


def test_all_is_pinned_and_every_name_resolves():
    assert set(guardrail.__all__) == EXPECTED
    for name in guardrail.__all__:
        assert getattr(guardrail, name) is not None


def test_config_errors_are_value_errors():
    assert issubclass(guardrail.ConfigError, ValueError)
    assert issubclass(guardrail.RequestError, ValueError)
    assert issubclass(guardrail.PromptInjectionBlocked, guardrail.GuardrailError)


def test_engine_errors_are_the_ones_the_engine_raises():
    from guardrail import errors

    assert guardrail.EngineDeadError is errors.EngineDeadError
    assert guardrail.EngineClosedError is errors.EngineClosedError
    assert issubclass(guardrail.EngineClosedError, guardrail.EngineDeadError)
    assert issubclass(guardrail.EngineDeadError, guardrail.GuardrailError)
