"""What the probe reads and how it scores, with no engine: model configs (``config``), requests
rendered into token spans (``prompts``), the pure score math (``scoring``) and the paged KV
cache layouts (``kv_layout``).

Example:
    >>> from guardrail.probe import GuardedPrompt
    >>> GuardedPrompt(instruction="Summarize.", data="Hi").data
    'Hi'
"""

from guardrail.probe.config import (
    Calibration,
    ModelProbeConfig,
    load_model_config,
    packaged_model_configs,
    read_model_config,
    resolve_config,
    shipped_variants,
)
from guardrail.probe.prompts import (
    GuardedPrompt,
    Message,
    PreparedPrompt,
    RequestLike,
    Segment,
    control_token_ids,
    mark_untrusted,
    prepare_prompt,
    prepare_prompts,
)

__all__ = [
    "Calibration",
    "GuardedPrompt",
    "Message",
    "ModelProbeConfig",
    "PreparedPrompt",
    "RequestLike",
    "Segment",
    "control_token_ids",
    "load_model_config",
    "mark_untrusted",
    "packaged_model_configs",
    "prepare_prompt",
    "prepare_prompts",
    "read_model_config",
    "resolve_config",
    "shipped_variants",
]
