"""A token model fitted on the GPU (what ``guardrail calibrate`` does where there is one) reaches
the optimum of scikit-learn's objective, as the host's fit does (tests/unit/test_token_fit_device.py
checks the same on the CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from guardrail.offline.token_readout import fit_tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_gpu_token_fit_equals_the_hosts() -> None:
    rng = np.random.default_rng(3)
    x = (rng.normal(0, 1, (20_000, 256)) * rng.uniform(0.2, 3, 256)).astype(np.float32)
    y = (x[:, :8].sum(1) / 4 + rng.logistic(0, 1, len(x)) > 0).astype(int)
    on_gpu = fit_tokens(x, y, layers=(5,), c=0.05, device="cuda")
    on_host = fit_tokens(x, y, layers=(5,), c=0.05, device="cpu")
    spread = np.ptp(on_host.logits(x))
    assert np.abs(on_gpu.logits(x) - on_host.logits(x)).max() < 1e-4 * spread
