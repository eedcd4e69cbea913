"""KV cache layouts against vLLM's own cache: vLLM lays it out and writes it, our readers read it.

Nothing about the layout is assumed here. For every case the cache is planned by the engine
core's ``get_kv_cache_config_from_groups`` (vllm/v1/core/kv_cache_utils.py) and allocated by the
model runner's ``allocate_kv_cache`` (vllm/v1/worker/utils.py), two layers sharing the buffer, in
every KV cache layout the backend declares (``supported_kv_cache_layouts``). Keys and values are
then written by the backend's own ``do_kv_cache_update``:

* CPU (``CPUAttentionBackendImpl``, ISA ``vec``): vLLM's own code all the way, its view and
  chunk of the cache and the C++ op ``torch.ops._C.cpu_attn_reshape_and_cache`` (called through
  ``cpu_attn_reshape_and_cache`` in vllm/_custom_ops.py).
* FlashAttention (``FlashAttentionImpl``): its ``do_kv_cache_update`` runs as is (its split of the
  cache into key and value views included), but the kernel it calls, ``reshape_and_cache_flash``
  (``torch.ops._C_cache_ops``), is CUDA-only and absent from vLLM's CPU build, and vLLM's Triton
  port of it needs Triton on a GPU. It is replaced by ``_reshape_and_cache_flash_on_cpu``, a
  line-by-line port of that Triton kernel's address arithmetic (quoted there).

On a real engine the worker checks the CPU layout on every scored request as well: the cached
key of the last prompt token must equal the key the layer computed (on the device, in
guardrail/worker/probe.py); tests/engine/test_engine.py compares scores with Hugging Face.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.config import CacheConfig, VllmConfig
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends import cpu_attn, flash_attn
from vllm.v1.attention.backends.utils import record_kv_cache_layout
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from guardrail.probe.kv_layout import (
    cpu_vec_key_view,
    cpu_vec_keys,
    flash_attn_key_view,
    flash_attn_keys,
    key_gather_for,
    key_view_for,
    register_kv_layout,
)

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
DTYPES = [torch.float32, torch.bfloat16]
CPU_LAYOUTS = cpu_attn.CPUAttentionBackend.supported_kv_cache_layouts()
# None: "the kernels consume any layout" (AttentionBackend.supported_kv_cache_layouts,
# vllm/v1/attention/backend.py).
FLASH_LAYOUTS = flash_attn.FlashAttentionBackend.supported_kv_cache_layouts() or tuple(
    KVCacheLayout
)

Write = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _vllm_kv_caches(
    layout: KVCacheLayout,
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """The per-layer caches of a two-layer model, planned and allocated by vLLM itself."""
    cache_config = CacheConfig(num_gpu_blocks_override=num_blocks)
    record_kv_cache_layout(cache_config, layout.name)
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=kv_heads, head_size=head_size, dtype=dtype
    )
    config = get_kv_cache_config_from_groups(
        VllmConfig(cache_config=cache_config),
        [KVCacheGroupSpec(list(LAYERS), spec)],
        available_memory=len(LAYERS) * num_blocks * spec.page_size_bytes,
    )
    caches = allocate_kv_cache(config, torch.device("cpu"), layout)
    return [caches[name] for name in LAYERS]


def _cpu_vec_write(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """vLLM's CPUAttentionBackendImpl.do_kv_cache_update writing the cache, run as is.

    That is (vllm/v1/attention/backends/cpu_attn.py)::

        kv_cache = kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))
        key_cache, value_cache = kv_cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                       layer.isa, ...)
    """
    impl: Any = SimpleNamespace(attn_type=AttentionType.DECODER, kv_cache_dtype="auto")
    layer: Any = SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0)
    cpu_attn.CPUAttentionBackendImpl.do_kv_cache_update(
        impl, layer, key, value, kv_cache, slot_mapping
    )


def _reshape_and_cache_flash_on_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """CPU port of vLLM's ``reshape_and_cache_flash`` kernel (CUDA/Triton only).

    Follows the non-head-major branch of ``reshape_and_cache_kernel_flash`` in
    vllm/v1/attention/ops/triton_reshape_and_cache_flash.py, addressing memory from the
    strides of the key/value views FlashAttentionImpl.do_kv_cache_update hands it::

        block_idx = slot_idx // block_size
        block_offset = slot_idx % block_size
        tgt_idx_k = (block_idx * block_stride + block_offset * page_stride
                     + cur_head * head_stride + cur_dim)
        tgt_idx_v = tgt_idx_k

    with ``block_size = key_cache.shape[1]``, ``head_stride = key_cache.stride()[2]``,
    ``block_stride = key_cache.stride()[0]``, ``page_stride = key_cache.stride()[1]``
    (``triton_reshape_and_cache_flash``, same file).
    """
    assert kv_cache_dtype == "auto"
    block_size = key_cache.shape[1]
    block_idx = (slot_mapping // block_size)[:, None, None]
    block_offset = (slot_mapping % block_size)[:, None, None]
    cur_head = torch.arange(key.shape[1])[None, :, None]
    cur_dim = torch.arange(key.shape[2])[None, None, :]
    block_stride, page_stride, head_stride = key_cache.stride()[:3]
    for src, cache in ((key, key_cache), (value, value_cache)):
        # tgt_idx_v = tgt_idx_k: the value view shares the key view's strides.
        assert cache.stride()[:3] == (block_stride, page_stride, head_stride)
        assert cache.stride(3) == 1  # the kernel steps cur_dim by one element
        tgt_idx = (
            block_idx * block_stride + block_offset * page_stride + cur_head * head_stride + cur_dim
        )
        # The kernel's pointer is the view's first element: add its offset in the storage.
        memory = torch.as_strided(
            cache, (cache.untyped_storage().nbytes() // cache.itemsize,), (1,), 0
        )
        memory[cache.storage_offset() + tgt_idx] = src.to(cache.dtype)


def _flash_attn_write(monkeypatch: pytest.MonkeyPatch) -> Write:
    monkeypatch.setattr(
        flash_attn, "reshape_and_cache_flash", _reshape_and_cache_flash_on_cpu, raising=False
    )

    def write(
        kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """vLLM's FlashAttentionImpl.do_kv_cache_update writing the cache, run as is.

        Its split of the cache is vLLM's (vllm/v1/attention/backends/flash_attn.py)::

            # (B, H, N, 2*D) -> ((B, N, H, D), (B, N, H, D))
            key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)

        only the kernel it then calls is the CPU port above.
        """
        impl: Any = SimpleNamespace(
            attn_type=AttentionType.DECODER, head_size=key.shape[-1], kv_cache_dtype="auto"
        )
        layer: Any = SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
        flash_attn.FlashAttentionImpl.do_kv_cache_update(
            impl, layer, key, value, kv_cache, slot_mapping
        )

    return write


def _round_trip(
    write: Write,
    read: Callable[..., torch.Tensor],
    caches: list[torch.Tensor],
    block_ids: list[int],
    view: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Fill every slot of both layers, write one request's keys, read them back per layer,
    through the reader and through the key view (what the fused kernel reads)."""
    num_blocks, kv_heads, block_size, two_dims = caches[0].shape
    head_size, dtype = two_dims // 2, caches[0].dtype
    gen = torch.Generator().manual_seed(0)

    def randn(tokens: int) -> torch.Tensor:
        return torch.randn(tokens, kv_heads, head_size, generator=gen).to(dtype)

    # Other requests' tokens everywhere, so a reader looking in the wrong place finds numbers.
    every_slot = torch.arange(num_blocks * block_size)
    for cache in caches:
        write(cache, randn(len(every_slot)), randn(len(every_slot)), every_slot)
    # This request: its blocks in block-table order, the last one partly filled.
    num_tokens = (len(block_ids) - 1) * block_size + block_size // 2 + 1
    slots = (torch.tensor(block_ids)[:, None] * block_size + torch.arange(block_size)).flatten()
    slots = slots[:num_tokens]
    keys = [randn(num_tokens) for _ in caches]
    for cache, layer_keys in zip(caches, keys, strict=True):
        write(cache, layer_keys, randn(num_tokens), slots)
    for cache, layer_keys in zip(caches, keys, strict=True):
        got = read(cache, slots)
        assert got.shape == (num_tokens, kv_heads, head_size)
        assert torch.equal(got, layer_keys)
        # The probe reads a step's rows at once, as a [rows, tokens] grid of slots.
        grid = torch.stack([slots, slots.flip(0)])
        both = read(cache, grid)
        assert both.shape == (2, num_tokens, kv_heads, head_size)
        assert torch.equal(both[0], layer_keys) and torch.equal(both[1], layer_keys.flip(0))
        # ... and only a layer's scored heads, head-major: [rows, heads, tokens, head_size]
        heads = torch.tensor([kv_heads - 1, 0, kv_heads - 1])
        per_head = read(cache, grid[:, None, :], heads[:, None])
        assert per_head.shape == (2, len(heads), num_tokens, head_size)
        assert torch.equal(per_head[0], layer_keys[:, heads].transpose(0, 1))
        assert torch.equal(per_head[1], layer_keys.flip(0)[:, heads].transpose(0, 1))
        keys_view = view(cache)
        assert keys_view.shape == (num_blocks, block_size, kv_heads, head_size)
        assert keys_view.data_ptr() == cache.data_ptr()  # a view, no copy
        assert torch.equal(keys_view[slots // block_size, slots % block_size], layer_keys)


# (num_blocks, block_size, kv_heads, head_size, block ids of the request in table order)
CPU_CASES = [
    (5, 32, 2, 64, [3, 0, 2]),
    (4, 64, 3, 32, [2, 3, 1]),
    (6, 32, 1, 128, [5, 1, 4, 0]),
    (3, 32, 4, 96, [2, 0]),
]
FLASH_CASES = [
    (6, 16, 2, 64, [4, 0, 2]),
    (5, 32, 1, 128, [1, 4, 3]),
    (4, 16, 4, 80, [3, 1]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", CPU_LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize(
    ("num_blocks", "block_size", "kv_heads", "head_size", "block_ids"), CPU_CASES
)
def test_cpu_vec_reads_what_vllms_cpu_backend_wrote(
    num_blocks, block_size, kv_heads, head_size, block_ids, layout, dtype
):
    caches = _vllm_kv_caches(layout, num_blocks, block_size, kv_heads, head_size, dtype)
    _round_trip(_cpu_vec_write, cpu_vec_keys, caches, block_ids, cpu_vec_key_view)
    # Not vacuous: the CPU kernel does not store keys the way FlashAttention does.
    slots = (torch.tensor(block_ids)[:, None] * block_size + torch.arange(block_size)).flatten()
    assert not torch.equal(flash_attn_keys(caches[0], slots), cpu_vec_keys(caches[0], slots))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", FLASH_LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize(
    ("num_blocks", "block_size", "kv_heads", "head_size", "block_ids"), FLASH_CASES
)
def test_flash_attn_reads_what_vllms_flash_attn_backend_wrote(
    num_blocks, block_size, kv_heads, head_size, block_ids, layout, dtype, monkeypatch
):
    caches = _vllm_kv_caches(layout, num_blocks, block_size, kv_heads, head_size, dtype)
    _round_trip(
        _flash_attn_write(monkeypatch), flash_attn_keys, caches, block_ids, flash_attn_key_view
    )


def test_unknown_layout_is_refused_with_a_fix():
    with pytest.raises(
        ValueError, match=r"unsupported KV cache layout: TritonAttentionImpl;"
    ) as err:
        key_gather_for("TritonAttentionImpl", None)
    message = str(err.value)
    assert "CPUAttentionBackendImpl (isa 'vec')" in message and "FlashAttentionImpl" in message
    assert "@register_kv_layout" in message and "guardrail/probe/kv_layout.py" in message
    with pytest.raises(ValueError, match="isa 'amx'"):
        key_gather_for("CPUAttentionBackendImpl", "amx")
    assert key_gather_for("CPUAttentionBackendImpl", "vec") is cpu_vec_keys
    assert key_gather_for("FlashAttentionImpl", None) is flash_attn_keys


def test_a_layout_is_registered_once():
    with pytest.raises(ValueError, match=r"FlashAttentionImpl is already registered"):
        register_kv_layout("FlashAttentionImpl")(flash_attn_keys)
    assert key_gather_for("FlashAttentionImpl", None) is flash_attn_keys


@pytest.mark.parametrize(
    ("backend", "fix"),
    [
        ("TritonAttentionImpl", r"dtype='bfloat16'.*--attention-backend FLASH_ATTN"),
        ("FlashInferImpl", r"--attention-backend FLASH_ATTN"),
    ],
)
def test_gpu_default_backends_without_a_reader_are_refused_with_the_flag_that_fixes_it(
    backend: str, fix: str
) -> None:
    """vLLM's defaults on current NVIDIA GPUs: Triton for float32, FlashInfer on Blackwell."""
    with pytest.raises(ValueError, match=fix):
        key_gather_for(backend, None)


def test_key_views_are_registered_with_their_readers():
    assert key_view_for("FlashAttentionImpl", None) is flash_attn_key_view
    assert key_view_for("CPUAttentionBackendImpl", "vec") is cpu_vec_key_view
    assert key_view_for("TritonAttentionImpl", None) is None
