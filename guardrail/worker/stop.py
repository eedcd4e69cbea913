"""The logits processor that ends probe-stopped requests right after their prefill."""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

from guardrail.worker.probe import PROBES

__all__ = ["ProbeStopLogitsProcessor"]


class ProbeStopLogitsProcessor(LogitsProcessor):
    """vLLM logits processor that ends probe-stopped requests right after their prefill.

    In the step where the probe decides to stop a request, this forces the request's first
    sampled token to its stop token, so the scheduler finishes it: one token, no decode steps.
    The decision stays on the device (``guardrail.worker.probe.Stops``).
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._config_id = id(vllm_config)

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        return None

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Any) -> None:
        return None  # the probe names the step's rows by batch index itself

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Rows the probe decided to stop get every logit at -inf but their stop token's; the
        decision is a device tensor, applied with one ``where`` (no synchronisation)."""
        probe = PROBES.get(self._config_id)
        stops = probe.stops if probe is not None else None
        if stops is None:
            return logits
        probe.stops = None  # type: ignore[union-attr]
        if max(stops.batch_index) >= logits.shape[0]:
            return logits  # not this step's logits (cannot happen in vLLM's V1 runner)
        index = stops.index
        forced = torch.full(
            (len(stops.batch_index), logits.shape[1]),
            float("-inf"),
            dtype=logits.dtype,
            device=logits.device,
        )
        forced.scatter_(1, stops.tokens[:, None], 0.0)
        chosen = torch.where(stops.stop[:, None], forced, logits.index_select(0, index))
        return logits.index_copy(0, index, chosen)
