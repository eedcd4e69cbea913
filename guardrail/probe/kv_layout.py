"""Reading keys back from vLLM's paged KV cache: a small registry of layouts, one per backend.

Prefix caching means a request's shared system prompt is not recomputed: its keys exist only in
the paged cache. The probe gathers the prompt keys of every row it scores in a step from the cache
at once, by KV slot (``block_table[position // block_size] * block_size + position %
block_size``, the addressing vLLM's ``slot_mapping`` uses). The physical layout is the attention
backend's business, so each supported layout is one function here, registered under the backend
it belongs to; an unknown layout is refused at start, never guessed.

vLLM 0.26 (GPU) and 0.32 (CPU) hand every backend a per-layer cache whose *logical* shape is
[num_blocks, num_kv_heads, block_size, 2 * head_size]; the resolved ``KVCacheLayout`` permutes
it physically through strides, and a backend's kernels may arrange the bytes inside a block their
own way (the CPU ``vec`` kernels do).

Adding a layout:
    1. Write ``def my_keys(kv_cache, slots, kv_heads=None) -> Tensor`` returning the keys
       stored at the KV slots ``slots`` (a long tensor of any shape ``S``), as
       ``[*S, num_kv_heads, head_size]``; with ``kv_heads`` (a long tensor broadcast against
       ``slots``, as advanced indices are) only those heads, ``[*broadcast shape, head_size]``:
       one gather, no Python loop, no host synchronisation.
    2. Decorate it with ``@register_kv_layout("<impl class name>", isa=...)``: the name is
       ``type(attention_layer.impl).__name__`` (e.g. ``"FlashAttentionImpl"``) and ``isa`` the
       ``isa`` attribute vLLM sets on the attention layer (the CPU backend does), or ``None``
       when the layout does not depend on one.
    3. Test it in tests/unit/test_kv_layout.py against a cache allocated by vLLM's own allocator
       and written by the backend's own cache-update code (see the tests there). At run time the
       worker also checks every scored request, on the device: the cached key of the last prompt
       token must equal the key the layer computed (``guardrail/worker/probe.py``).

Example:
    >>> key_gather_for("CPUAttentionBackendImpl", "vec") is cpu_vec_keys
    True
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KeyView = Callable[[torch.Tensor], torch.Tensor]
"""``kv_cache -> keys [num_blocks, block_size, num_kv_heads, head_size]``: a strided view of the
key channels, no copy (the fused probe kernel reads it through its strides)."""

KeyGather = Callable[..., torch.Tensor]
"""``(kv_cache, slots [*S], kv_heads=None) -> keys``: ``[*S, num_kv_heads, head_size]``, or with
``kv_heads`` (a long tensor broadcastable against ``slots``) only those heads,
``[*broadcast(S, kv_heads.shape), head_size]`` (one gather for a layer's scored heads)."""

_KV_LAYOUTS: dict[tuple[str, str | None], tuple[KeyGather, str]] = {}
_KEY_VIEWS: dict[tuple[str, str | None], KeyView] = {}


def register_kv_layout(
    backend_name: str, *, isa: str | None = None, note: str = "", view: KeyView | None = None
) -> Callable[[KeyGather], KeyGather]:
    """Register the decorated function as the key reader of ``backend_name`` (and ``isa``).

    ``backend_name`` is the class name of the attention layer's ``impl``; ``isa`` the layer's
    ``isa`` attribute, or ``None`` for a layout that does not depend on one. ``note`` (when the
    layout applies, how to get it) is shown in the error for unsupported layouts. ``view``, where
    the keys of a block are addressable by strides, gives them as a ``KeyView`` (the fused probe
    kernel reads through it; without one the probe gathers with the reader). Registering the
    same backend and ISA twice is an error, never a silent override.

    Example:
        >>> @register_kv_layout("DocExampleImpl", note="doctest only")
        ... def example_keys(kv_cache, slots):
        ...     return kv_cache
        >>> key_gather_for("DocExampleImpl", None) is example_keys
        True
        >>> _ = _KV_LAYOUTS.pop(("DocExampleImpl", None))
    """
    key = (backend_name, isa)

    def register(gather: KeyGather) -> KeyGather:
        if key in _KV_LAYOUTS:
            raise ValueError(
                f"KV cache layout of {_describe(*key)} is already registered "
                f"({_KV_LAYOUTS[key][0].__qualname__})"
            )
        _KV_LAYOUTS[key] = (gather, note)
        if view is not None:
            _KEY_VIEWS[key] = view
        return gather

    return register


def _describe(backend_name: str, isa: str | None) -> str:
    return backend_name if isa is None else f"{backend_name} (isa {isa!r})"


def cpu_vec_key_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The CPU (ISA ``vec``) cache's keys as [blocks, block_size, kv_heads, dim] (a view).

    Example:
        >>> cpu_vec_key_view(torch.zeros(4, 1, 2, 2 * 3)).shape
        torch.Size([4, 2, 1, 3])
    """
    num_blocks, num_kv_heads, block_size, two_dims = kv_cache.shape
    tiles = kv_cache.view(num_blocks, num_kv_heads, 2, two_dims // 2, block_size)
    return tiles[:, :, 0].permute(0, 3, 1, 2)


@register_kv_layout(
    "CPUAttentionBackendImpl",
    view=cpu_vec_key_view,
    isa="vec",
    note="vLLM's CPU backend on x86 (on CPUs with AMX: dtype not bfloat16), block size and head "
    "size multiples of 32",
)
def cpu_vec_keys(
    kv_cache: torch.Tensor, slots: torch.Tensor, kv_heads: torch.Tensor | None = None
) -> torch.Tensor:
    """Keys from vLLM's CPU attention cache (ISA ``vec``) at ``slots``, as [*S, kv_heads, dim].

    The CPU kernels store, per (block, kv head), the keys first as a transposed [dim, block_size]
    tile (so a query multiplies a contiguous tile), then the values. The CPU backend accepts only
    the ``LBHNC`` layout, where each (block, kv head) plane is contiguous. Checked against the
    keys the layer computed, not assumed: the worker compares, on every scored request, the cached
    key of the last prompt token with the key the layer computed (guardrail/worker/probe.py),
    the engine parity tests (tests/engine/test_engine.py) compare scores read through the prefix
    cache with Hugging Face, and tests/unit/test_kv_layout.py reads back keys written by vLLM's
    own CPU cache-update op.

    Example:
        >>> cache = torch.zeros(4, 1, 2, 2 * 3)  # 4 blocks, 1 kv head, block 2, dim 3
        >>> cpu_vec_keys(cache, torch.tensor([[4, 5, 0]])).shape
        torch.Size([1, 3, 1, 3])
    """
    num_blocks, num_kv_heads, block_size, two_dims = kv_cache.shape
    dim = two_dims // 2
    tiles = kv_cache.view(num_blocks, num_kv_heads, 2, dim, block_size)
    if kv_heads is None:
        # Advanced indices on dims 0 and 4, split by slices: the result is [*S, kv_heads, dim].
        return tiles[slots // block_size, :, 0, :, slots % block_size]
    # Advanced indices on dims 0-2 and 4, split by a slice: [*broadcast shape, dim].
    return tiles[slots // block_size, kv_heads, 0, :, slots % block_size]


def flash_attn_key_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The FlashAttention cache's keys as [blocks, block_size, kv_heads, dim] (a view, any
    stride order: the first ``dim`` channels of the logical [blocks, kv_heads, block_size,
    2 * dim] cache).

    Example:
        >>> flash_attn_key_view(torch.zeros(4, 2, 16, 2 * 8)).shape
        torch.Size([4, 16, 2, 8])
    """
    return kv_cache[..., : kv_cache.shape[-1] // 2].transpose(1, 2)


@register_kv_layout(
    "FlashAttentionImpl",
    view=flash_attn_key_view,
    note="vLLM's FlashAttention backend on GPU (--attention-backend FLASH_ATTN), any KV cache "
    "layout",
)
def flash_attn_keys(
    kv_cache: torch.Tensor, slots: torch.Tensor, kv_heads: torch.Tensor | None = None
) -> torch.Tensor:
    """Keys from the FlashAttention (GPU) cache at ``slots``, as [*S, kv_heads, dim].

    FlashAttention reads the logical [blocks, kv_heads, block_size, 2 * dim] cache as
    ``kv_cache.transpose(1, 2).split(dim, -1)``: keys are the first ``dim`` channels of each
    (block, slot, head). Indexing the logical view keeps it right for every stride order.

    Example:
        >>> cache = torch.zeros(4, 2, 16, 2 * 8)
        >>> flash_attn_keys(cache, torch.arange(10)).shape
        torch.Size([10, 2, 8])
    """
    num_blocks, num_kv_heads, block_size, two_dims = kv_cache.shape
    keys = kv_cache[..., : two_dims // 2]  # a view: only the key channels are read
    try:  # token-major storage (vLLM's default NHD layout): slots index one flat axis
        flat = keys.transpose(1, 2).view(num_blocks * block_size, num_kv_heads, two_dims // 2)
    except RuntimeError:  # head-major storage: address (block, head, offset)
        if kv_heads is None:
            return keys[slots // block_size, :, slots % block_size]
        return keys[slots // block_size, kv_heads, slots % block_size]
    return flat[slots] if kv_heads is None else flat[slots, kv_heads]


def key_view_for(backend_name: str, isa: str | None) -> KeyView | None:
    """The key view registered for an attention backend (and ISA), or None.

    Example:
        >>> key_view_for("FlashAttentionImpl", None) is flash_attn_key_view
        True
    """
    return _KEY_VIEWS.get((backend_name, isa)) or _KEY_VIEWS.get((backend_name, None))


BACKEND_FIXES = {
    "TritonAttentionImpl": "vLLM picks Triton attention for float32 on CUDA: start the engine in "
    "the model's dtype (dtype='bfloat16' or 'float16', the GPU default) or with "
    "attention_backend='FLASH_ATTN' (--attention-backend FLASH_ATTN)",
    "FlashInferImpl": "vLLM picks FlashInfer on some GPUs (Blackwell): start the engine with "
    "attention_backend='FLASH_ATTN' (--attention-backend FLASH_ATTN) where FlashAttention runs",
}
"""What to do about a backend vLLM picks by default on current NVIDIA GPUs that has no reader."""


def key_gather_for(backend_name: str, isa: str | None) -> KeyGather:
    """The key reader registered for an attention backend (and ISA), or a ``ValueError``.

    A reader registered with ``isa=None`` serves every ISA of its backend. The error names the
    registered layouts and how to add one.

    Example:
        >>> key_gather_for("FlashAttentionImpl", None) is flash_attn_keys
        True
        >>> key_gather_for("TritonAttentionImpl", None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: unsupported KV cache layout: TritonAttentionImpl; ... @register_kv_layout ...
    """
    entry = _KV_LAYOUTS.get((backend_name, isa)) or _KV_LAYOUTS.get((backend_name, None))
    if entry is not None:
        return entry[0]
    supported = "; ".join(
        f"{_describe(*key)}: {note}" if note else _describe(*key)
        for key, (_, note) in sorted(_KV_LAYOUTS.items(), key=lambda item: str(item[0]))
    )
    raise ValueError(
        f"unsupported KV cache layout: {_describe(backend_name, isa)}; the guardrail probe reads "
        f"prefix-cached keys from the paged cache and knows: {supported}. "
        f"{BACKEND_FIXES.get(backend_name, 'Use one of those backends')}, or add the layout: a "
        "reader decorated with @register_kv_layout in guardrail/probe/kv_layout.py (see its "
        "module docstring)."
    )
