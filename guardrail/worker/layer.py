"""A hooked attention layer as the probe holds it (``guardrail.worker.probe``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Layer"]


@dataclass
class Layer:
    """One hooked attention layer: which heads this rank scores there, the ``impl.forward``
    the probe wrapped (put back at uninstall), and where its heads sit in the step's table."""

    index: int
    local_heads: torch.Tensor  # query heads of this rank to score, local indices
    kv_heads: torch.Tensor  # [h, 1] the kv head each of them reads (GQA), local indices
    global_heads: list[int]
    impl: Any
    original_forward: Any
    had_instance_forward: bool
    column: int = 0  # where its heads start in the step's table of this rank's heads
    host_heads: list[int] = field(default_factory=list)  # ``local_heads`` on the host
    host_kv_heads: list[int] = field(default_factory=list)  # ``kv_heads`` on the host
    # fused kernel: the layer's place in the step's query stash while its group's one kernel
    # scores it (-1: its own kernel, as it runs), the KV cache it ran on and that cache's
    # address, and its queries' (shape of a token, dtype)
    slot: int = -1
    cache: torch.Tensor | None = None
    cache_ptr: int = 0
    query_form: tuple[Any, ...] = ()
