"""The one exception tree of the library, rooted at ``GuardrailError``.

Errors a user can fix by changing an argument or a file also subclass ``ValueError``.

    GuardrailError
    ├── ConfigError (ValueError)            a model config, policy or argument is invalid
    │   ├── ModelConfigNotFoundError        no calibrated config for the served model
    │   └── HeadsDoNotFitModelError         a config's heads are outside the loaded model
    ├── RequestError (ValueError)           one request is malformed (empty, too long, ...)
    ├── ModelUnavailableError               the embedded model's package or tools are missing
    ├── EngineNotGuardableError             the engine runs in a mode where the probe cannot fire
    ├── EngineDeadError                     the engine's processes died; carries fail-closed results
    │   └── EngineClosedError               the engine was closed before the call
    └── PromptInjectionBlocked              a policy blocked the request; carries the verdict
"""

from __future__ import annotations

from typing import Any


class GuardrailError(Exception):
    """Base of every error raised by this library."""


class ConfigError(GuardrailError, ValueError):
    """A model config, a policy or an argument is invalid; the message says how to fix it."""


class ModelConfigNotFoundError(ConfigError):
    """No probe config exists for the served model."""


class HeadsDoNotFitModelError(ConfigError):
    """A config names a layer or head the loaded model does not have."""


class RequestError(GuardrailError, ValueError):
    """One request is malformed; other requests of the same batch are unaffected."""


class ModelUnavailableError(GuardrailError):
    """The embedded model cannot be prepared (package or conversion tools missing)."""


class EngineNotGuardableError(GuardrailError):
    """The engine runs in a configuration where the probe cannot fire; refusing to run unguarded."""


class EngineDeadError(GuardrailError):
    """The engine cannot answer: its engine-core or worker process died (unrecoverable; start a
    new engine). Raised within seconds of the death, by the call that was running and by every
    later call.

    ``results`` is None when raised by ``HookedLLM``. ``GuardedLLM`` sets it to one result per
    request of the batch: the ones it could not answer carry a fail-closed (block) verdict and
    this error, never generated text (docs/reliability.md).
    """

    def __init__(self, message: str, results: Any = None) -> None:
        super().__init__(message)
        self.results = results


class EngineClosedError(EngineDeadError):
    """The engine was closed (``close()``, or at interpreter exit) before the call."""


class PromptInjectionBlocked(GuardrailError):
    """A policy blocked the request. ``verdict`` holds the full decision record."""

    def __init__(self, message: str, verdict: Any = None, results: Any = None) -> None:
        super().__init__(message)
        self.verdict = verdict
        self.results = results  # every result of the batch, when raised by GuardedLLM
