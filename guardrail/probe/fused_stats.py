"""The probe's attention stats in one kernel per layer: keys read through the paged cache, an
online softmax, running sums per span.

On a GPU the probe's cost is host time: each hooked layer used to launch a dozen small kernels
(gather the queries, gather the keys, a batched product, then masks, softmax and sums at the end
of the step), and their Python ran between vLLM's compiled pieces. This module does the same
arithmetic in one Triton kernel per layer. Each program takes one (row, head): it walks the
row's KV slots in blocks, reads the keys straight from the cache (any strides: the backend's
key view, ``guardrail.probe.kv_layout.key_view_for``), keeps the running maximum logit and, under
it, the sums of ``exp(logit - max)`` over all tokens, the instruction and the data, plus what the
data entropy needs, and writes the five :data:`~guardrail.probe.scoring.ATTENTION_STATS` of the
row and head into the step's table. Nothing is copied, nothing waits for the host.

The stats equal :func:`~guardrail.probe.scoring.stats_from_logits` up to float32 summation order.
The data entropy uses the identity, with ``e_i = exp(l_i - max)``, ``S`` their sum, ``S_d`` and
``U = sum_d e_i (l_i - max)`` over the data, ``c = S_d + EPS * S`` (``share_i = e_i / c``, as the
reference divides by ``data_mass + EPS``)::

    -sum_d share_i log(share_i) = (S_d log(c) - U) / c

(the reference's ``+ 1e-12`` inside the log moves the result by at most 1e-12 per token).

Triton is imported lazily: without it (the CPU build of vLLM) :func:`fused_available` is False
and the probe keeps its PyTorch path. ``GUARDRAIL_PROBE_KERNEL=torch`` also keeps it (for
comparing the two on one machine).

Example:
    >>> fused_available("cpu")
    False
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from guardrail.probe.scoring import ATTENTION_STATS, EPS

__all__ = ["KERNEL_ENV", "fused_available", "span_stats_into"]

KERNEL_ENV = "GUARDRAIL_PROBE_KERNEL"
"""Environment variable: ``torch`` keeps the PyTorch path where the kernel could run."""
BLOCK_TOKENS = 64
"""Keys per block of a program's walk over its row."""


def fused_available(device: Any) -> bool:
    """Whether the kernel runs for tensors on ``device``: a CUDA device, Triton importable, and
    ``GUARDRAIL_PROBE_KERNEL`` not ``torch``. (Tests run it on CPU tensors under Triton's
    interpreter, ``TRITON_INTERPRET=1``, by calling :func:`span_stats_into` directly.)"""
    if torch.device(device).type != "cuda" or os.environ.get(KERNEL_ENV) == "torch":
        return False
    return _kernel() is not None


@functools.cache
def _kernel() -> Any:
    """The Triton kernel (compiled per specialisation on first use); None without Triton."""
    try:
        from guardrail.probe._fused_kernel import span_stats
    except ImportError:
        return None
    return span_stats


def span_stats_into(
    out: torch.Tensor,
    column: int,
    query: torch.Tensor,
    token_rows: torch.Tensor,
    heads: torch.Tensor,
    kv_heads: torch.Tensor,
    keys: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    instruction: torch.Tensor,
    data: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> None:
    """Write the :data:`~guardrail.probe.scoring.ATTENTION_STATS` of every (row, head) into
    ``out[:, column : column + len(heads)]``, in one kernel launch.

    Shapes: out [rows, columns, 5] float32 contiguous; query [tokens, query heads, dim] (the
    step's queries); token_rows [rows] (each row's last prompt token in the step); heads and
    kv_heads [heads] (the scored query heads and the kv head each reads); keys [blocks,
    block_size, kv heads, dim] (the backend's key view of the cache, any strides); slots [rows,
    T] (the KV slot of each prompt position); lengths [rows] (prompt tokens per row, at most T);
    instruction and data [rows, T] bool. Equals :func:`~guardrail.probe.scoring.stats_from_logits`
    of :func:`~guardrail.probe.scoring.batched_logits` over the same keys (float32 sums).
    """
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the fused probe kernel needs Triton")
    rows, count = token_rows.shape[0], heads.shape[0]
    if not rows or not count:
        return
    if (
        out.dtype != torch.float32
        or not out.is_contiguous()
        or out.shape[2] != len(ATTENTION_STATS)
    ):
        raise ValueError(f"out must be a contiguous float32 [rows, columns, 5], got {out.shape}")
    if instruction.stride() != data.stride() or slots.stride(1) != 1 or data.stride(1) != 1:
        raise ValueError("slots, instruction and data must be row-major with the same row stride")
    if any(t.stride(0) != 1 for t in (token_rows, lengths, heads, kv_heads)):
        raise ValueError("token_rows, lengths, heads and kv_heads must be contiguous")
    if query.stride(-1) != 1:
        raise ValueError("query's last axis must be contiguous")
    dim = query.shape[-1]
    block_size = keys.shape[1]
    kernel[(rows, count)](
        out,
        query,
        query.stride(0),
        query.stride(1),
        keys,
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        keys.stride(3),
        token_rows,
        lengths,
        slots,
        instruction,
        data,
        heads,
        kv_heads,
        slots.stride(0),
        data.stride(0),
        column,
        out.shape[1],
        float(scale),
        float(softcap or 1.0),
        block_size=block_size,
        dim=dim,
        block_dim=max(16, 1 << (dim - 1).bit_length()),
        block_tokens=BLOCK_TOKENS,
        use_softcap=bool(softcap),
        eps=EPS,
    )
