"""The hidden-state signal against an independent reference: Hugging Face ``output_hidden_states``.

One multi-process engine on tiny Llama reads the residual stream at the last prompt token of
layers 0-2 (whole streams, as calibration does) and a config's sparse read-out on layers 1 and 2
(as serving does), in the same pass as the attention probe. Every request of an 18-request batch
(chunked prefill: 128 tokens per step; the second pass reads the shared system prompt from the
prefix cache) must match the streams transformers computes on the same token ids, and the focus
the worker uses for early stops must be the one the caller computes.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from guardrail.probe.config import ModelProbeConfig
from tests.helpers import _load, hf_head_stats, mixed_batch

RAW_LAYERS = [0, 1, 2]  # tiny_hidden_engine reads these layers' whole streams


@pytest.fixture
def engine(tiny_hidden_engine: Any) -> Any:
    return tiny_hidden_engine


@lru_cache(maxsize=64)
def hf_streams(model_dir: str, token_ids: tuple[int, ...]) -> dict[int, np.ndarray]:
    """The residual stream after each decoder layer at the last token (HF, float32)."""
    model = _load(model_dir)
    with torch.no_grad():
        out = model(torch.tensor([list(token_ids)]), output_hidden_states=True)
    # hidden_states[0] is the embedding; [i + 1] the output of layer i (the last one normed)
    return {i: out.hidden_states[i + 1][0, -1].double().numpy() for i in RAW_LAYERS}


def test_hidden_streams_and_terms_equal_hf_with_chunked_prefill_and_prefix_cache(
    engine: Any, tiny_llama_dir: Path
) -> None:
    config = engine.config
    batch = mixed_batch()
    assert len(batch) >= 16
    first = engine.generate(batch, engine.sampling(max_tokens=2))
    second = engine.generate(batch, engine.sampling(max_tokens=2))
    assert sum(o.num_cached_tokens for o in second) > 0  # prefix cache in use
    assert max(len(o.prompt.token_ids) for o in first) > 128  # chunked prefill in use
    for out in first + second:
        probe = out.probe
        assert out.error is None and probe is not None and probe.error is None, probe
        p = out.prompt
        ref = hf_streams(str(tiny_llama_dir), tuple(p.token_ids))
        assert sorted(probe.hidden_states) == RAW_LAYERS
        for layer in RAW_LAYERS:
            got = np.asarray(probe.hidden_states[layer])
            np.testing.assert_allclose(got, ref[layer], atol=5e-5, rtol=1e-5)
        want_terms = {part.layer: part.project(ref[part.layer]) for part in config.hidden}
        assert probe.hidden == pytest.approx(want_terms, abs=5e-5)
        stats = hf_head_stats(
            str(tiny_llama_dir), p.token_ids, p.instruction_spans, p.data_spans, config.heads
        )
        assert probe.focus == pytest.approx(config.focus(stats, want_terms), abs=5e-5)


def test_hidden_terms_move_the_focus(engine: Any) -> None:
    """The read-out is part of the score: without it the same heads give another focus."""
    out = engine.score([("Summarize.", "Hi Bob, lunch at noon?")])[0]
    config = engine.config
    without = ModelProbeConfig(**{**config.model_dump(), "hidden": None})
    heads_only = without.focus(out.probe.head_stats)
    assert abs(out.probe.focus - heads_only) > 1e-3


def test_early_stop_uses_the_hidden_terms_like_the_caller(engine: Any) -> None:
    """The worker decides early stops on the same combined focus the caller computes: a stop
    threshold just above a request's focus ends it after prefill, one just below does not."""
    request = ("Summarize the email.", "Hi Bob, lunch at noon? The room is booked.")
    focus = engine.score([request])[0].probe.focus
    params = engine.sampling(max_tokens=6, ignore_eos=False)
    above, below = (
        engine.generate([request], params, stop_below=focus + d)[0] for d in (2e-4, -2e-4)
    )
    assert above.probe.stopped and len(above.token_ids) <= 1
    assert not below.probe.stopped and len(below.token_ids) > 1
