"""The hidden-state signal in vLLM's compiled mode (CPU), against Hugging Face eager.

One compiled engine (``enforce_eager=False``: torch.compile/Inductor, attention as the splitting
op) on tiny Llama reads the config of ``tiny_hidden_config`` (last token on layers 1-2, data
mean on layers 2-3, a token read-out over layers 1 and 3) and the whole streams of layers 0-1
(as calibration reads them), through the stream taps its worker put on the decoder layers
before vLLM compiled them. Every request of an 18-request batch (chunked prefill: 128 tokens
per step; the second pass serves the prompts, data included, from the prefix cache) must give
the hidden terms Hugging Face gives on the same token ids, within 5e-6, and the focus the
caller computes from them. The engine is shared by the module: compiling takes most of its
start-up (2 cores: ~10 s with Inductor's cache warm, ~85 s cold, so the module is marked slow;
it also starts an engine of its own).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.engine.test_hidden_state import (
    cached_and_chunked_passes,
    decoded_tokens_as_data,
    expected_terms,
    hf_streams,
)
from tests.helpers import hf_head_stats, mixed_batch, start_engine, tiny_hidden_config

pytestmark = pytest.mark.slow

RAW_LAYERS = [0, 1]
TERM_TOLERANCE = 5e-6
STREAM_TOLERANCE = 5e-6
DEVIATIONS: dict[str, float] = {}  # the largest deviation seen per quantity (printed with -s)


@pytest.fixture(scope="module")
def compiled(tiny_llama_dir: Path) -> Iterator[Any]:
    started = time.perf_counter()
    engine = start_engine(
        tiny_llama_dir,
        multiprocess=True,
        enforce_eager=False,
        probe_config=tiny_hidden_config(),
        probe_hidden_layers=RAW_LAYERS,
        probe_data_mean_layers=RAW_LAYERS,
        num_gpu_blocks_override=1024,  # the whole-stream memo holds 128 floats per KV slot
    )
    print(f"\ncompiled engine started in {time.perf_counter() - started:.1f} s")
    yield engine
    engine.close()
    print(f"largest deviations from Hugging Face: {DEVIATIONS}")


def _deviation(name: str, got: Any, want: Any) -> float:
    value = float(np.max(np.abs(np.asarray(got, dtype=np.float64) - np.asarray(want))))
    DEVIATIONS[name] = max(DEVIATIONS.get(name, 0.0), value)
    return value


def check_against_hf(engine: Any, model_dir: Path, outputs: list[Any]) -> None:
    config = engine.config
    for out in outputs:
        probe = out.probe
        assert out.error is None and probe is not None and probe.error is None, probe
        p = out.prompt
        spans = tuple(tuple(s) for s in p.data_spans)
        last, mean, data = hf_streams(str(model_dir), tuple(p.token_ids), spans)
        assert sorted(probe.hidden_states) == RAW_LAYERS
        assert sorted(probe.data_mean_states) == (RAW_LAYERS if mean else [])
        for layer in RAW_LAYERS:
            assert _deviation("last stream", probe.hidden_states[layer], last[layer]) <= (
                STREAM_TOLERANCE
            )
            if mean:
                got = probe.data_mean_states[layer]
                assert _deviation("data-mean stream", got, mean[layer]) <= STREAM_TOLERANCE
        want = expected_terms(config, last, mean, data)
        assert sorted(probe.hidden) == sorted(want)
        for layer, term in want.items():
            assert _deviation(f"term layer {layer}", probe.hidden[layer], term) <= TERM_TOLERANCE
        stats = hf_head_stats(
            str(model_dir), p.token_ids, p.instruction_spans, p.data_spans, config.heads
        )
        assert probe.focus == pytest.approx(config.focus(stats, want), abs=5e-5)


def test_the_engine_is_compiled_and_reads_hidden_layers(compiled: Any) -> None:
    info = compiled.model_info
    assert info["enforce_eager"] is False
    assert info["compilation_mode"] not in ("CompilationMode.NONE", "None", "0")
    assert info["hidden_layers"] == [0, 1, 2, 3]


def test_compiled_hidden_terms_equal_hf_with_chunked_prefill_and_prefix_cache(
    compiled: Any, tiny_llama_dir: Path
) -> None:
    check_against_hf(compiled, tiny_llama_dir, cached_and_chunked_passes(compiled))


def test_compiled_data_mean_reads_decoded_tokens_from_the_prefix_cache(
    compiled: Any, tiny_llama_dir: Path
) -> None:
    """The memo the worker keeps is written in decode steps too."""
    check_against_hf(compiled, tiny_llama_dir, [decoded_tokens_as_data(compiled)])


def test_compiled_early_stop_uses_the_hidden_terms(compiled: Any) -> None:
    """The worker's early stop decides on the combined focus, hidden terms included, in
    compiled mode too."""
    request = ("Summarize the email.", "Hi Bob, lunch at noon? The room is booked.")
    focus = compiled.score([request])[0].probe.focus
    params = compiled.sampling(max_tokens=6, ignore_eos=False)
    above, below = (
        compiled.generate([request], params, stop_below=focus + d)[0] for d in (2e-4, -2e-4)
    )
    assert above.probe.stopped and len(above.token_ids) <= 1
    assert not below.probe.stopped and len(below.token_ids) > 1


def test_compiled_terms_equal_the_eager_engines(compiled: Any, tiny_hidden_engine: Any) -> None:
    """The same config on the session's eager engine (forward hooks): the same terms, streams
    and focus, request by request."""
    assert tiny_hidden_engine.config == compiled.config
    batch = mixed_batch()
    params = compiled.sampling(max_tokens=1)
    eager = tiny_hidden_engine.generate(batch, params)
    for mine, theirs in zip(compiled.generate(batch, params), eager, strict=True):
        a, b = mine.probe, theirs.probe
        assert a.error is None and b.error is None
        assert sorted(a.hidden) == sorted(b.hidden)
        for layer, term in b.hidden.items():
            assert _deviation(f"eager term layer {layer}", a.hidden[layer], term) <= TERM_TOLERANCE
        for layer in RAW_LAYERS:
            got, want = a.hidden_states[layer], b.hidden_states[layer]
            assert _deviation("eager last stream", got, want) <= STREAM_TOLERANCE
        assert _deviation("eager focus", a.focus, b.focus) <= 2e-5
