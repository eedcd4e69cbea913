"""KV cache layouts on synthetic tensors: write keys the way each backend does, read them back."""

from __future__ import annotations

import pytest
import torch

from guardrail.probe.kv_layout import cpu_vec_keys, flash_attn_keys, key_gather_for


def _keys(tokens, kv_heads, dim):
    return torch.arange(tokens * kv_heads * dim, dtype=torch.float32).view(tokens, kv_heads, dim)


def test_cpu_vec_layout_round_trip():
    num_blocks, kv_heads, block, dim, tokens = 8, 3, 4, 5, 10
    cache = torch.full((num_blocks, kv_heads, block, 2 * dim), -1.0)
    block_ids = torch.tensor([6, 1, 3])
    keys = _keys(tokens, kv_heads, dim)
    # Write as the CPU "vec" kernel does: per (block, head) a [dim, block] key tile, then values.
    flat = cache.view(num_blocks, kv_heads, 2 * block * dim)
    for t in range(tokens):
        blk, slot = block_ids[t // block], t % block
        tile = flat[blk, :, : block * dim].view(kv_heads, dim, block)
        tile[:, :, slot] = keys[t]
    got = cpu_vec_keys(cache, block_ids, tokens)
    assert torch.equal(got, keys)


@pytest.mark.parametrize("physical", ["LBHNC", "LBNHC"])
def test_flash_attn_layout_round_trip(physical):
    num_blocks, kv_heads, block, dim, tokens = 6, 2, 16, 8, 37
    if physical == "LBHNC":
        cache = torch.zeros(num_blocks, kv_heads, block, 2 * dim)
    else:  # blocks, slots, heads in memory; same logical [B, H, N, 2D] shape via strides
        cache = torch.zeros(num_blocks, block, kv_heads, 2 * dim).permute(0, 2, 1, 3)
    block_ids = torch.tensor([4, 0, 2])
    keys = _keys(tokens, kv_heads, dim)
    # Write through FlashAttention's own view: (B, H, N, 2D) -> (B, N, H, D) keys.
    key_cache, value_cache = cache.transpose(1, 2).split(dim, dim=-1)
    value_cache.fill_(-7.0)
    for t in range(tokens):
        key_cache[block_ids[t // block], t % block] = keys[t]
    got = flash_attn_keys(cache, block_ids, tokens)
    assert torch.equal(got, keys)


def test_unknown_layout_is_refused_with_a_fix():
    with pytest.raises(ValueError, match=r"unsupported KV cache layout.*FlashAttentionImpl"):
        key_gather_for("TritonAttentionImpl", None)
    with pytest.raises(ValueError, match="isa 'amx'"):
        key_gather_for("CPUAttentionBackendImpl", "amx")
    assert key_gather_for("CPUAttentionBackendImpl", "vec") is cpu_vec_keys
