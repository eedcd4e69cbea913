"""``GuardCore``: what the sync ``GuardedLLM`` and the ``AsyncGuardedLLM`` both are: an engine,
the ``Decider`` that holds the guard's config, policies and settings, and whether closing the
guard closes the engine. Each guard adds only how it calls its engine.

Example:
    >>> from guardrail.guard import GuardedLLM
    >>> issubclass(GuardedLLM, GuardCore)
    True
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

from guardrail.guard.decider import Decider
from guardrail.guard.settings import GuardSettings, VerdictObserver
from guardrail.policy.kinds import Policy
from guardrail.probe.config import ModelProbeConfig

__all__ = ["GuardCore"]


class _Closable(Protocol):
    def close(self) -> None: ...


EngineT = TypeVar("EngineT", bound=_Closable)


class GuardCore(Generic[EngineT]):
    """An ``engine`` guarded by a ``decider`` (which tells its metrics observer the policies
    now); ``close()`` closes the engine when ``owns_engine`` (a guard that started its engine
    owns it; a shared engine is left running)."""

    def __init__(self, engine: EngineT, decider: Decider, owns_engine: bool) -> None:
        self.engine = engine
        self.decider = decider
        self._owns_engine = owns_engine
        decider.announce()

    # The guard's settings live in its ``Decider``.
    @property
    def config(self) -> ModelProbeConfig:
        return self.decider.config

    @property
    def threshold(self) -> float | None:
        return self.decider.threshold

    @property
    def policies(self) -> tuple[Policy, ...]:
        return self.decider.policies

    @property
    def settings(self) -> GuardSettings:
        return self.decider.settings

    @property
    def on_block(self) -> str:
        return self.decider.settings.on_block

    @property
    def refusal_text(self) -> str:
        return self.decider.settings.refusal_text

    @property
    def metrics(self) -> VerdictObserver | None:
        return self.decider.settings.metrics

    @property
    def early_block(self) -> bool:
        return self.decider.settings.early_block

    @property
    def model_name(self) -> str:
        return self.decider.model_name

    def close(self) -> None:
        """Shut the engine down if this guard started it (a shared engine is left running)."""
        if self._owns_engine:
            self.engine.close()
