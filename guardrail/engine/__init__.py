"""The caller side of the engine: ``HookedLLM`` (offline vLLM), ``AsyncHookedLLM`` (vLLM's
``AsyncLLM``, for servers), the ``ProbeClient`` both use, the steering component, and the
``GuardEngine`` protocol.

Importing this package does not import vLLM; starting an engine does.

Example:
    >>> from guardrail.engine import HookedLLM  # doctest: +SKIP
"""

from guardrail.engine.async_hooked import AsyncHookedLLM
from guardrail.engine.client import ProbeClient
from guardrail.engine.hooked import HookedLLM
from guardrail.engine.steering import SteeringClient
from guardrail.engine.types import (
    FOCUS,
    GuardedChunk,
    GuardedOutput,
    GuardEngine,
    ProbeResult,
    per_request,
)

__all__ = [
    "FOCUS",
    "AsyncHookedLLM",
    "GuardEngine",
    "GuardedChunk",
    "GuardedOutput",
    "HookedLLM",
    "ProbeClient",
    "ProbeResult",
    "SteeringClient",
    "per_request",
]
