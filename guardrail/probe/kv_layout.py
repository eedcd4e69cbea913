"""Reading keys back from vLLM's paged KV cache, one small function per attention backend.

Prefix caching means a request's shared system prompt is not recomputed: its keys exist only in
the paged cache. The probe gathers all prompt keys of a request from the cache through its block
table. The physical layout is the backend's business, so each supported layout is one function
here, tested on synthetic tensors; an unknown layout is refused at start, never guessed.

vLLM 0.32 hands every backend a per-layer cache whose *logical* shape is
[num_blocks, num_kv_heads, block_size, 2 * head_size] (strides may permute it physically).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KeyGather = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def cpu_vec_keys(kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Keys from vLLM's CPU attention cache (ISA ``vec``), as [num_tokens, kv_heads, dim].

    The CPU kernels store, per (block, kv head), the keys first as a transposed [dim, block_size]
    tile (so a query multiplies a contiguous tile), then the values. Measured against the
    keys the layer computed, not assumed: see tests/engine/test_kv_layout_live.py.

    Example:
        >>> cache = torch.zeros(4, 1, 2, 2 * 3)  # 4 blocks, 1 kv head, block 2, dim 3
        >>> cpu_vec_keys(cache, torch.tensor([2, 0]), 3).shape
        torch.Size([3, 1, 3])
    """
    num_blocks, kv_heads, block_size, two_dims = kv_cache.shape
    dim = two_dims // 2
    tiles = kv_cache.view(num_blocks, kv_heads, 2 * block_size * dim)[
        block_ids, :, : block_size * dim
    ]
    tiles = tiles.view(len(block_ids), kv_heads, dim, block_size)
    keys = tiles.permute(0, 3, 1, 2).reshape(len(block_ids) * block_size, kv_heads, dim)
    return keys[:num_tokens]


def flash_attn_keys(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Keys from the FlashAttention (GPU) cache, as [num_tokens, kv_heads, dim].

    FlashAttention reads the logical [blocks, kv_heads, block_size, 2 * dim] cache as
    ``kv_cache.transpose(1, 2).split(dim, -1)``: keys are the first ``dim`` channels of each
    (block, slot, head). Indexing the logical view keeps it right for every stride order.

    Example:
        >>> cache = torch.zeros(4, 2, 16, 2 * 8)
        >>> flash_attn_keys(cache, torch.tensor([3]), 10).shape
        torch.Size([10, 2, 8])
    """
    _, kv_heads, block_size, two_dims = kv_cache.shape
    dim = two_dims // 2
    keys = kv_cache[block_ids][..., :dim]  # [blocks, kv_heads, block_size, dim]
    keys = keys.permute(0, 2, 1, 3).reshape(len(block_ids) * block_size, kv_heads, dim)
    return keys[:num_tokens]


def key_gather_for(backend_name: str, isa: str | None) -> KeyGather:
    """The key reader for an attention backend, or a ``ValueError`` naming what is supported."""
    if backend_name == "CPUAttentionBackendImpl" and isa == "vec":
        return cpu_vec_keys
    if backend_name == "FlashAttentionImpl":
        return flash_attn_keys
    raise ValueError(
        f"unsupported KV cache layout: backend {backend_name!r} (isa {isa!r}); the guardrail probe "
        "reads prefix-cached keys from the paged cache and knows CPUAttentionBackendImpl (isa vec: "
        "x86 without AMX, head size a multiple of 32) and FlashAttentionImpl. Use one of those "
        "backends (e.g. dtype float32 on CPU, or "
        "--attention-backend FLASH_ATTN on GPU), or add the layout to guardrail/probe/kv_layout.py."
    )
