"""The logits processor that ends probe-stopped requests right after their prefill."""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

from guardrail.protocol import PROBE_ARG
from guardrail.worker.probe import PROBES

__all__ = ["ProbeStopLogitsProcessor"]


class ProbeStopLogitsProcessor(LogitsProcessor):
    """vLLM logits processor that ends probe-stopped requests right after their prefill.

    In the step where the probe decides to stop a request, this forces the request's first
    sampled token to its stop token, so the scheduler finishes it: one token, no decode steps.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._config_id = id(vllm_config)
        self._rows: dict[int, tuple[str, int]] = {}  # batch index -> (probe key, stop token)

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        return None

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Any) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._rows.pop(index, None)
        for index, params, _prompt, _output in batch_update.added:
            spec = (params.extra_args or {}).get(PROBE_ARG) if params is not None else None
            if spec and spec.get("stop_token") is not None:
                self._rows[index] = (spec["key"], int(spec["stop_token"]))
            else:
                self._rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            moving = self._rows.pop(a, None)
            other = self._rows.pop(b, None)
            if direction.name == "SWAP" and other is not None:
                self._rows[a] = other
            if moving is not None:
                self._rows[b] = moving

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        probe = PROBES.get(self._config_id)
        if probe is None or not probe.stop_keys:
            return logits
        for index, (key, stop_token) in self._rows.items():
            if key in probe.stop_keys and index < logits.shape[0]:
                probe.stop_keys.discard(key)
                logits[index] = float("-inf")
                logits[index, stop_token] = 0.0
        return logits
