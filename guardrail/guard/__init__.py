"""The guard: ``GuardedLLM`` (policies over an engine), its retry loop, and the micro-batcher
that lets many callers share one engine (LangChain adapters, servers).

Example:
    >>> from guardrail.guard import GuardedLLM  # doctest: +SKIP
"""

from guardrail.guard.guarded import (
    BLOCKED_FINISH_REASON,
    DEFAULT_REFUSAL,
    GuardedLLM,
    GuardedResult,
    VerdictObserver,
)
from guardrail.guard.retry import RetryLoop, retry_vector
from guardrail.guard.settings import GuardSettings

__all__ = [
    "BLOCKED_FINISH_REASON",
    "DEFAULT_REFUSAL",
    "GuardSettings",
    "GuardedLLM",
    "GuardedResult",
    "RetryLoop",
    "VerdictObserver",
    "retry_vector",
]
