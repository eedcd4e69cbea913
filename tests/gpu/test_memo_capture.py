"""On a CUDA GPU (skipped elsewhere): the data-mean memo write is safe to capture in a CUDA
graph. The worker's ``MemoWriter`` runs once under capture, reading the step's slot mapping
from a persistent buffer as vLLM's full graphs do; each replay must then write the *current*
buffer's slots with the *current* stream, exactly as the eager write does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from guardrail.probe.config import HiddenLayerProbe
from guardrail.worker.hidden import MemoWriter, Readout, new_memo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_captured_memo_write_replays_with_each_steps_slots_and_stream():
    from vllm.forward_context import override_forward_context

    torch.manual_seed(0)
    part = HiddenLayerProbe(
        layer=0,
        dims=[3, 17, 200],
        mean=[0.0] * 3,
        scale=[1.0, 2.0, 4.0],
        weights=[0.5, -1.0, 2.0],
        position="data_mean",
    )
    slots_total, tokens = 4096, 32
    writer = MemoWriter(Readout.of(part, "cuda"), new_memo(slots_total, "cuda"))
    hidden = torch.zeros(tokens, 256, device="cuda", dtype=torch.bfloat16)  # static inputs
    residual = torch.zeros_like(hidden)
    slot_buffer = torch.full((tokens,), -1, device="cuda", dtype=torch.long)
    context = SimpleNamespace(attn_metadata=SimpleNamespace(slot_mapping=slot_buffer))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), override_forward_context(context):  # type: ignore[arg-type]
        writer(hidden, residual)  # warm-up, outside the graph
        with torch.cuda.graph(graph, stream=stream):
            writer(hidden, residual)
    torch.cuda.current_stream().wait_stream(stream)
    writer.memo.fill_(float("nan"))
    reference = torch.full_like(writer.memo, float("nan"))
    eager = MemoWriter(writer.readout, reference)
    for step in range(5):
        used = tokens - 7 * (step % 3)  # padded tail: slot -1
        slots = torch.randperm(slots_total, device="cuda")[:used]
        slot_buffer.fill_(-1)
        slot_buffer[:used] = slots
        hidden.copy_(torch.randn_like(hidden))
        residual.copy_(torch.randn_like(residual))
        graph.replay()
        with override_forward_context(context):  # type: ignore[arg-type]
            eager(hidden, residual)
        torch.cuda.synchronize()
        written = writer.memo[slots]
        assert torch.isfinite(written).all()
        torch.testing.assert_close(writer.memo[:-1], reference[:-1], equal_nan=True, rtol=0, atol=0)
    assert int(torch.isfinite(writer.memo[:-1]).sum()) > 4 * tokens  # many steps' slots kept
