"""The probe's attention stats in one kernel: keys read through the paged cache, an online
softmax, running sums per span.

On a GPU the probe's cost is host time: each hooked layer used to launch a dozen small kernels
(gather the queries, gather the keys, a batched product, then masks, softmax and sums at the end
of the step), and their Python ran between vLLM's compiled pieces. This module does the same
arithmetic in Triton. Each program takes one (row, head): it walks the row's KV slots in
blocks, reads the keys straight from the cache (any strides: the backend's key view,
``guardrail.probe.kv_layout.key_view_for``), keeps the running maximum logit and, under it, the
sums of ``exp(logit - max)`` over all tokens, the instruction and the data, plus what the data
entropy needs, and writes the five :data:`~guardrail.probe.scoring.ATTENTION_STATS` of the row
and head into the step's table. Nothing is copied, nothing waits for the host.

Two launches share that program. :func:`span_stats_into` scores one layer's heads, from the
step's queries and that layer's cache. :func:`span_stats_layers_into` scores every layer of a
step at once, after the last of them ran (their caches still hold the keys): each layer only
copied its queries at the rows' last prompt tokens into a stash, and a column table
(:func:`column_table`) says, per column of the grid, which layer (its stash slot and its cache,
at an element offset from the first layer's: :func:`key_offsets`), which query head and which
kv head. The probe uses the second (``guardrail.worker.probe``: one launch per step instead of
one per layer) for the layers whose caches share one geometry, scale and softcap, the first for
any other.

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
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from guardrail.probe.scoring import ATTENTION_STATS, EPS

__all__ = [
    "KERNEL_ENV",
    "column_table",
    "fused_available",
    "key_offsets",
    "span_stats_into",
    "span_stats_layers_into",
]

KERNEL_ENV = "GUARDRAIL_PROBE_KERNEL"
"""Environment variable: ``torch`` keeps the PyTorch path where the kernel could run."""
BLOCK_TOKENS = 64
"""Keys per block of a program's walk over its row."""
WIDTH = len(ATTENTION_STATS)


def fused_available(device: Any) -> bool:
    """Whether the kernel runs for tensors on ``device``: a CUDA device, Triton importable, and
    ``GUARDRAIL_PROBE_KERNEL`` not ``torch``. (Tests run it on CPU tensors under Triton's
    interpreter, ``TRITON_INTERPRET=1``, by calling :func:`span_stats_into` directly.)"""
    if torch.device(device).type != "cuda" or os.environ.get(KERNEL_ENV) == "torch":
        return False
    return _kernel() is not None


@functools.cache
def _kernel() -> Any:
    """The module of the Triton kernels (each compiled per specialisation on first use); None
    without Triton."""
    try:
        from guardrail.probe import _fused_kernel
    except ImportError:
        return None
    return _fused_kernel


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
    kernels = _kernel()
    if kernels is None:
        raise RuntimeError("the fused probe kernel needs Triton")
    rows, count = token_rows.shape[0], heads.shape[0]
    if not rows or not count:
        return
    _check_step(out, slots, instruction, data)
    if any(t.stride(0) != 1 for t in (token_rows, lengths, heads, kv_heads)):
        raise ValueError("token_rows, lengths, heads and kv_heads must be contiguous")
    if query.stride(-1) != 1:
        raise ValueError("query's last axis must be contiguous")
    dim = query.shape[-1]
    block_size = keys.shape[1]
    kernels.span_stats[(rows, count)](
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


def _check_step(
    out: torch.Tensor, slots: torch.Tensor, instruction: torch.Tensor, data: torch.Tensor
) -> None:
    """The layouts both kernels read the step's table and masks in (``ValueError`` otherwise)."""
    if out.dtype != torch.float32 or not out.is_contiguous() or out.shape[2] != WIDTH:
        raise ValueError(f"out must be a contiguous float32 [rows, columns, 5], got {out.shape}")
    if instruction.stride() != data.stride() or slots.stride(1) != 1 or data.stride(1) != 1:
        raise ValueError("slots, instruction and data must be row-major with the same row stride")


def key_offsets(views: Sequence[torch.Tensor]) -> list[int | None]:
    """Where each layer's keys lie from the first layer's, in elements: the multi-layer kernel
    reads layer ``L``'s keys at ``views[0]``'s address plus ``offsets[L]``, through
    ``views[0]``'s strides. None for a view that cannot be read so: another shape, strides,
    dtype or device, or not a whole number of elements away.

    Example:
        >>> caches = torch.zeros(2, 4, 2, 16, 8).unbind(0)  # two layers' caches
        >>> key_offsets([c[..., :4] for c in caches])
        [0, 1024]
        >>> key_offsets([caches[0][..., :4], caches[1][..., :2]])
        [0, None]
    """
    base = views[0]
    size, start, form = base.element_size(), base.data_ptr(), _form(base)
    offsets: list[int | None] = []
    for view in views:
        apart = view.data_ptr() - start
        offsets.append(apart // size if _form(view) == form and apart % size == 0 else None)
    return offsets


def _form(view: torch.Tensor) -> tuple[Any, ...]:
    return view.shape, view.stride(), view.dtype, view.device


def column_table(layers: Sequence[tuple[int, Sequence[int], Sequence[int], int]]) -> np.ndarray:
    """The multi-layer kernel's columns, [4, columns] int64: each column's stash layer, query
    head, kv head and column of the stats table, from (stash layer, query heads, their kv heads,
    first column in the table) per layer.

    Example:
        >>> column_table([(0, [1, 5], [0, 2], 0), (1, [3], [1], 4)]).tolist()
        [[0, 0, 1], [1, 5, 3], [0, 2, 1], [0, 1, 4]]
    """
    table = [
        (slot, head, kv_head, first + i)
        for slot, heads, kv_heads, first in layers
        for i, (head, kv_head) in enumerate(zip(heads, kv_heads, strict=True))
    ]
    return np.array(table, dtype=np.int64).reshape(-1, 4).T.copy()


def span_stats_layers_into(
    out: torch.Tensor,
    stash: torch.Tensor,
    columns: torch.Tensor,
    keys: torch.Tensor,
    offsets: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    instruction: torch.Tensor,
    data: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> None:
    """The stats of every (row, column) of ``columns``, over several layers, in one kernel
    launch: each column as :func:`span_stats_into` computes it for its layer and head (the same
    program per (row, head), so the same values), written to its column of ``out``.

    Shapes: out [rows, out columns, 5] float32 contiguous; stash [layers, rows, query heads,
    dim] contiguous (each layer's queries at the rows' last prompt tokens); columns [4, count]
    int64 contiguous (:func:`column_table`: stash layer, query head, kv head, out column);
    keys the first layer's key view [blocks, block_size, kv heads, dim] (any strides) and
    offsets [layers] int64 (:func:`key_offsets`: every layer's keys, same strides); slots,
    lengths, instruction and data as for :func:`span_stats_into`.
    """
    kernels = _kernel()
    if kernels is None:
        raise RuntimeError("the fused probe kernel needs Triton")
    rows, count = stash.shape[1], columns.shape[1]
    if not rows or not count:
        return
    # checked once per step (the layers only copied their queries into the stash)
    _check_step(out, slots, instruction, data)
    if not (stash.is_contiguous() and columns.is_contiguous() and offsets.is_contiguous()):
        raise ValueError("stash, columns and offsets must be contiguous")
    if lengths.stride(0) != 1:
        raise ValueError("lengths must be contiguous")
    dim = stash.shape[-1]
    kernels.span_stats_layers[(rows, count)](
        out,
        stash,
        stash.stride(0),
        stash.stride(1),
        stash.stride(2),
        columns,
        count,
        offsets,
        keys,
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        keys.stride(3),
        lengths,
        slots,
        instruction,
        data,
        slots.stride(0),
        data.stride(0),
        out.shape[1],
        float(scale),
        float(softcap or 1.0),
        block_size=keys.shape[1],
        dim=dim,
        block_dim=max(16, 1 << (dim - 1).bit_length()),
        block_tokens=BLOCK_TOKENS,
        use_softcap=bool(softcap),
        eps=EPS,
    )
