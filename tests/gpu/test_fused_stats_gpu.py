"""On a CUDA GPU (skipped elsewhere): the compiled fused probe kernels against the PyTorch path,
at the sizes a served batch has, and the engine choosing them: one layer per launch, every
layer in one launch (against the one-layer kernel: the same program per (row, head)), and the
worker's probe grouping its layers into that launch from its second step.

Both sides read the same bfloat16 cache and compute in float32, so they differ only by the
order of float32 sums (the kernel sums each block of 64 keys, then rescales running sums; the
reference takes a softmax over the whole row): a few ulps of float32 per sum, carried through
rows of up to 4,096 tokens. ``TOL`` allows 1e-5; the measured largest difference is printed.
"""

from __future__ import annotations

import pytest
import torch

from tests.fused_cases import (
    CASES,
    fused,
    fused_layers,
    fused_probe,
    layers_case,
    paged_case,
    per_layer,
    run_step,
    torch_path,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOL = 1e-5
SAME_PROGRAM_TOL = 1e-6
"""The multi-layer kernel against the one-layer kernel: the same program per (row, head), the
same order of sums; only the compiler's choices (say, a fused multiply-add) could differ."""


def test_triton_is_used_on_this_gpu():
    from guardrail.probe.fused_stats import fused_available

    assert fused_available("cuda")


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_the_torch_path_on_the_gpu(name):
    lengths, spans = CASES[name]
    case = paged_case(lengths, spans, device="cuda")
    torch.testing.assert_close(fused(*case, scale=0.25), torch_path(*case, scale=0.25))


def test_kernel_at_served_sizes():
    """32 rows of 256-4,096 tokens, 32 query heads over 8 kv heads of size 128, 8 scored heads,
    bfloat16 cache in 16-token blocks (a layer of an 8B-shaped model)."""
    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(256, 4097, (32,), generator=gen).tolist()
    spans = [([(0, 40), (n - 8, n)], [(40, n - 8)]) for n in lengths]
    cache, query, *rest = paged_case(
        lengths, spans, heads=(0, 3, 9, 14, 17, 22, 28, 31), q_heads=32, kv=8, dim=128,
        block=16, seed=3, device="cuda",
    )  # fmt: skip
    case = (cache.bfloat16(), (query * 0.3).bfloat16(), *rest)
    got = fused(*case, scale=128**-0.5)
    expected = torch_path(*case, scale=128**-0.5)
    error = (got - expected).abs().max().item()
    print(
        f"\nfused kernel against the torch path, 32 rows x 8 heads: largest difference {error:.2e}"
    )
    assert error <= TOL


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_one_launch_over_every_layer_on_the_gpu(name, softcap):
    """Three layers' separate caches (GQA, different heads per layer, mixed lengths)."""
    lengths, spans = CASES[name]
    case = layers_case(lengths, spans, device="cuda")
    kw = {"scale": 0.25, "softcap": softcap}
    got = fused_layers(*case, **kw)
    one_by_one = per_layer(fused, *case, **kw)
    same = SAME_PROGRAM_TOL
    torch.testing.assert_close(got, one_by_one, rtol=same, atol=same)
    torch.testing.assert_close(got, per_layer(torch_path, *case, **kw))


def test_one_launch_at_served_sizes():
    """Four layers of an 8B-shaped model (32 query heads over 8 kv heads of size 128, bfloat16
    caches in 16-token blocks, 8 scored heads each), 32 rows of 256-4,096 tokens."""
    gen = torch.Generator().manual_seed(11)
    lengths = torch.randint(256, 4097, (32,), generator=gen).tolist()
    spans = [([(0, 40), (n - 8, n)], [(40, n - 8)]) for n in lengths]
    heads = [(0, 3, 9, 14, 17, 22, 28, 31), (1, 2, 8, 15, 16, 23, 24, 30)] * 2
    caches, queries, *rest = layers_case(
        lengths, spans, heads, q_heads=32, kv=8, dim=128, block=16, seed=5, device="cuda"
    )
    case = ([c.bfloat16() for c in caches], [(q * 0.3).bfloat16() for q in queries], *rest)
    kw = {"scale": 128**-0.5}
    got = fused_layers(*case, **kw)
    one_by_one = (got - per_layer(fused, *case, **kw)).abs().max().item()
    error = (got - per_layer(torch_path, *case, **kw)).abs().max().item()
    print(
        f"\none launch over 4 layers x 32 rows x 8 heads: largest difference {one_by_one:.2e} "
        f"from the one-layer kernel, {error:.2e} from the torch path"
    )
    assert one_by_one <= SAME_PROGRAM_TOL and error <= TOL


def test_the_probe_launches_once_per_step_on_the_gpu():
    """The worker's step path, compiled: the first step runs each layer's kernel, the next
    stashes the queries and runs one launch; both equal the PyTorch path."""
    lengths, spans = CASES["mixed lengths over several blocks"]
    caches, queries, heads, kv_heads, *masks = layers_case(lengths, spans, device="cuda")
    probe = fused_probe(device="cuda")
    first = run_step(probe, caches, queries, *masks)
    fused = probe.fused
    assert fused.group is not None and len(fused.group.layers) == 3, fused.error
    second = run_step(probe, caches, queries, *masks)
    assert first.stash is None and second.stash is not None
    torch.testing.assert_close(second.stats, first.stats, rtol=1e-6, atol=1e-6)
    expected = per_layer(torch_path, caches, queries, heads, kv_heads, *masks, scale=0.25)
    torch.testing.assert_close(second.stats, expected)
