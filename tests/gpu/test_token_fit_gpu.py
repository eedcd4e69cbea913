"""Token models fitted on the GPU (what ``guardrail calibrate`` does where there is one: all of
them together) reach the optimum of scikit-learn's objective, as the host's fits do
(tests/unit/test_token_fit_device.py checks the same on the CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from guardrail.offline.token_readout import fit_tokens, fit_tokens_jointly

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_gpu_token_fit_equals_the_hosts() -> None:
    rng = np.random.default_rng(3)
    x = (rng.normal(0, 1, (20_000, 256)) * rng.uniform(0.2, 3, 256)).astype(np.float32)
    y = (x[:, :8].sum(1) / 4 + rng.logistic(0, 1, len(x)) > 0).astype(int)
    on_gpu = fit_tokens(x, y, layers=(5,), c=0.05, device="cuda")
    on_host = fit_tokens(x, y, layers=(5,), c=0.05, device="cpu")
    spread = np.ptp(on_host.logits(x))
    assert np.abs(on_gpu.logits(x) - on_host.logits(x)).max() < 1e-4 * spread


def test_models_fitted_together_on_the_gpu_equal_the_hosts() -> None:
    rng = np.random.default_rng(4)
    x = (rng.normal(0, 1, (12_000, 128)) * rng.uniform(0.2, 3, 128) + 5).astype(np.float16)
    y = ((x[:, :8].astype(np.float32).sum(1) - 40) / 4 + rng.logistic(0, 1, len(x)) > 0).astype(int)
    folds = rng.integers(0, 3, len(y))
    masks = [folds != f for f in range(3)] + [np.ones(len(y), dtype=bool)]
    problems = [(m, c) for c in (0.01, 0.2) for m in masks]
    together = fit_tokens_jointly(x, y, problems, layers=(5,), device="cuda")
    for (mask, c), model in zip(problems, together, strict=True):
        own = fit_tokens(x[mask], y[mask], layers=(5,), c=c, device="cpu")
        spread = np.ptp(own.logits(x[mask]))
        assert np.abs(model.logits(x[mask]) - own.logits(x[mask])).max() < 1e-3 * spread
