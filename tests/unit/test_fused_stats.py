"""The fused probe kernel against the PyTorch path it replaces, on the same paged cache.

On CPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``): the same program,
executed with numpy, so its arithmetic is checked wherever Triton is installed. The CPU build of
vLLM does not install Triton, so CI skips this file; tests/gpu runs the compiled kernel on the
H200 against the same reference (and the engine's stats against Hugging Face).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from guardrail.probe import fused_stats
from guardrail.probe.kv_layout import flash_attn_key_view
from tests.fused_cases import (
    CASES,
    fused,
    fused_layers,
    layers_case,
    paged_case,
    per_layer,
    torch_path,
)

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed (the CPU build of vLLM has none)", allow_module_level=True)


@pytest.fixture(autouse=True)
def _interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by Triton when it is first imported
    if "triton" in sys.modules and "guardrail.probe._fused_kernel" not in sys.modules:
        pytest.skip("Triton was imported before this test could select its interpreter")
    fused_stats._kernel.cache_clear()
    yield
    fused_stats._kernel.cache_clear()


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_kernel_equals_the_torch_path(name, softcap):
    lengths, spans = CASES[name]
    case = paged_case(lengths, spans)
    kw = {"scale": 0.25, "softcap": softcap}
    expected = torch_path(*case, **kw)
    got = fused(*case, **kw)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-6)


def test_kernel_reads_bfloat16_caches_and_queries():
    lengths, spans = CASES["mixed lengths over several blocks"]
    cache, query, *rest = paged_case(lengths, spans, dim=64, block=32, seed=1)
    case = (cache.bfloat16(), query.bfloat16(), *rest)
    kw = {"scale": 0.125}
    torch.testing.assert_close(fused(*case, **kw), torch_path(*case, **kw), rtol=2e-5, atol=2e-6)


def test_the_kernel_is_not_offered_without_a_gpu():
    assert not fused_stats.fused_available("cpu")


def test_strided_row_vectors_are_refused():
    """The kernel reads per-row values by index: a strided view (a column of a [K, 4] table)
    would be read at the wrong places, so it is refused rather than misread."""
    lengths, spans = CASES["mixed lengths over several blocks"]
    cache, query, token_rows, *rest = paged_case(lengths, spans)
    strided = torch.stack([token_rows, token_rows], 1)[:, 0]
    with pytest.raises(ValueError, match="contiguous"):
        fused(cache, query, strided, *rest, scale=0.25)


# -- every layer in one launch -------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_one_launch_over_every_layer_equals_the_kernel_per_layer(name, softcap):
    """Three layers' caches (separate tensors at unrelated addresses), different heads per
    layer over shared kv heads (GQA), rows of mixed lengths: the multi-layer kernel runs the
    same program per (row, head) as the one-layer kernel, so the values are the same bits; both
    equal the PyTorch path."""
    lengths, spans = CASES[name]
    case = layers_case(lengths, spans)
    kw = {"scale": 0.25, "softcap": softcap}
    got = fused_layers(*case, **kw)
    assert torch.equal(got, per_layer(fused, *case, **kw))
    torch.testing.assert_close(got, per_layer(torch_path, *case, **kw), rtol=2e-5, atol=2e-6)


def test_one_launch_reads_bfloat16_caches_and_queries():
    lengths, spans = CASES["mixed lengths over several blocks"]
    caches, queries, *rest = layers_case(lengths, spans, dim=64, block=32, seed=1)
    case = ([c.bfloat16() for c in caches], [q.bfloat16() for q in queries], *rest)
    kw = {"scale": 0.125}
    torch.testing.assert_close(
        fused_layers(*case, **kw), per_layer(torch_path, *case, **kw), rtol=2e-5, atol=2e-6
    )


def test_each_layer_is_read_from_its_own_cache():
    """The layers' offsets are what select their caches: offsets naming another layer's cache
    give other stats (so the equality above depends on them)."""
    lengths, spans = CASES["mixed lengths over several blocks"]
    case = layers_case(lengths, spans)
    views = [flash_attn_key_view(cache) for cache in case[0]]
    right = fused_stats.key_offsets(views)
    expected = per_layer(fused, *case, scale=0.25)
    for wrong in ([0, 0, 0], [right[0], right[2], right[1]]):
        got = fused_layers(*case, offsets=wrong, scale=0.25)
        assert not torch.allclose(got, expected)
        assert torch.equal(got[:, :4], expected[:, :4])  # the first layer's heads: offset 0


def test_key_offsets_refuse_views_of_another_geometry():
    caches = [torch.zeros(6, 2, 16, 32) for _ in range(3)]
    caches[2] = caches[2].transpose(1, 2).contiguous().transpose(1, 2)  # head-major storage
    views = [flash_attn_key_view(cache) for cache in caches]
    offsets = fused_stats.key_offsets(views)
    assert offsets[0] == 0
    assert offsets[1] == (views[1].data_ptr() - views[0].data_ptr()) // 4
    assert offsets[2] is None
    assert fused_stats.key_offsets([views[0], views[1].bfloat16()])[1] is None
    assert fused_stats.key_offsets([views[0], views[1][:, :8]])[1] is None
