"""What the worker's forward hooks read from vLLM: the model's decoder layers, and the step's
attention metadata (the batch layout: ``query_start_loc``, ``seq_lens``, ``block_table``).

Shared by the steering hooks (``guardrail.worker.steering``) and the hidden-state hooks
(``guardrail.worker.hidden``), which both hook decoder layers and map rows of the step's
flattened batch back to requests.
"""

from __future__ import annotations

from typing import Any

__all__ = ["decoder_layers", "step_metadata"]


def decoder_layers(runner: Any) -> Any | None:
    """The model's decoder layers (``model.model.layers``), or None for a model without them."""
    return getattr(getattr(runner.model, "model", None), "layers", None)


def step_metadata(context: Any) -> Any | None:
    """The attention metadata of this forward step (vLLM keeps one per layer in a dict; the
    batch layout is the same in each), or None in warm-up, profiling and micro-batched steps."""
    metadata: Any = context.attn_metadata
    if isinstance(metadata, dict):
        metadata = next(iter(metadata.values()), None)
    if metadata is None or isinstance(metadata, list):
        return None
    return metadata
