"""On a CUDA GPU (skipped elsewhere): the compiled fused probe kernel against the PyTorch path,
at the sizes a served batch has, and the engine choosing it.

Both sides read the same bfloat16 cache and compute in float32, so they differ only by the
order of float32 sums (the kernel sums each block of 64 keys, then rescales running sums; the
reference takes a softmax over the whole row): a few ulps of float32 per sum, carried through
rows of up to 4,096 tokens. ``TOL`` allows 1e-5; the measured largest difference is printed.
"""

from __future__ import annotations

import pytest
import torch

from tests.fused_cases import CASES, fused, paged_case, torch_path

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOL = 1e-5


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
