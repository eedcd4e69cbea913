"""On a CUDA GPU (skipped elsewhere): the worker's host-to-device staging copies arrive intact
while the GPU is busy, for every dtype and shape a step sends, and never wait for the queue."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from guardrail.worker.rows import HostStaging

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_staged_copies_arrive_intact_behind_queued_work():
    staging = HostStaging("cuda")
    rng = np.random.default_rng(0)
    big = torch.randn(8192, 8192, device="cuda")
    for round_ in range(3):  # sizes grow, then shrink: buffers are replaced and reused
        for _ in range(100):  # ~150 ms of queued work the copies must not wait for
            torch.mm(big, big)
        sent, got = [], []
        for i in range(HostStaging.SLOTS):  # once round the ring
            shape = (3, 1 + (i + round_) % 7, 17 + 131 * (3 - round_) * (i % 5))
            values = [
                rng.random(shape) > 0.5,
                rng.integers(-(2**40), 2**40, size=shape[1:]),
                rng.normal(size=shape[2]),
                rng.integers(0, 256, size=shape, dtype=np.uint8),  # the plan's packed bytes
            ][i % 4]
            start = time.perf_counter()
            got.append(staging.to_device(values))
            enqueue = time.perf_counter() - start
            sent.append(values)
            assert enqueue < 0.02, f"copy {i} waited {enqueue:.3f} s: it synchronised"
        torch.cuda.synchronize()
        for values, tensor in zip(sent, got, strict=True):
            assert tensor.device.type == "cuda" and tuple(tensor.shape) == values.shape
            assert np.array_equal(tensor.cpu().numpy(), values)
