"""Ready-made policies, installed as ``guardrail.policies``.

Example:
    >>> from guardrail.policies import STRICT_BLOCK
    >>> STRICT_BLOCK.effective_threshold(0.5)
    0.6
"""

from guardrail.policies.prompt_injection import (
    BLOCK_INJECTIONS,
    DEFAULT,
    FLAG_INJECTIONS,
    FORGED_TURN_PATTERNS,
    FORGED_TURNS,
    MONITOR_ONLY,
    RETRY_STEERED,
    SHADOW_BLOCK,
    STRICT_BLOCK,
    SUSPICIOUS,
    TIERED,
    TRIAL,
)

__all__ = [
    "BLOCK_INJECTIONS",
    "DEFAULT",
    "FLAG_INJECTIONS",
    "FORGED_TURNS",
    "FORGED_TURN_PATTERNS",
    "MONITOR_ONLY",
    "RETRY_STEERED",
    "SHADOW_BLOCK",
    "STRICT_BLOCK",
    "SUSPICIOUS",
    "TIERED",
    "TRIAL",
]
