"""The hidden-state signal against an independent reference: Hugging Face ``output_hidden_states``.

One multi-process engine on tiny Llama reads the residual stream of layers 0-2 at the last
prompt token and averaged over the data tokens (whole streams, as calibration does), and a
config's sparse read-outs on layers 1-3 at both positions (as serving does), in the same pass as
the attention probe. Every request of an 18-request batch (chunked prefill: 128 tokens per step;
the second pass serves the prompts, data included, from the prefix cache) must match the streams
transformers computes on the same token ids, and the focus the worker uses for early stops must
be the one the caller computes. Requests that share a document in their cached prefix read its
data tokens' streams from the memo kept next to the KV cache, and still match.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from guardrail.probe.config import ModelProbeConfig
from tests.helpers import ATTACK, FILLER, SYSTEM, _load, hf_head_stats, mixed_batch

RAW_LAYERS = [0, 1, 2]  # tiny_hidden_engine reads these layers' whole streams


@pytest.fixture
def engine(tiny_hidden_engine: Any) -> Any:
    return tiny_hidden_engine


@lru_cache(maxsize=64)
def hf_streams(
    model_dir: str,
    token_ids: tuple[int, ...],
    data_spans: tuple[tuple[int, int], ...],
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray], dict[int, np.ndarray]]:
    """The residual stream after each decoder layer (HF, float32): at the last token, averaged
    over the data tokens, and at each data token (no entry without data). Layer 3 is the
    model's last: HF norms its output, so it is read from a model without the final norm."""
    model = _load(model_dir, dtype, device)
    norm, model.model.norm = model.model.norm, torch.nn.Identity()
    try:
        with torch.no_grad():
            ids = torch.tensor([list(token_ids)], device=device)
            out = model(ids, output_hidden_states=True)
    finally:
        model.model.norm = norm
    # hidden_states[0] is the embedding; [i + 1] the output of layer i
    layers = range(len(out.hidden_states) - 1)
    last = {i: out.hidden_states[i + 1][0, -1].double().cpu().numpy() for i in layers}
    positions = [t for a, b in data_spans for t in range(a, b)]
    data = {
        i: out.hidden_states[i + 1][0, positions].double().cpu().numpy()
        for i in layers
        if positions
    }
    mean = {i: streams.mean(0) for i, streams in data.items()}
    return last, mean, data


def expected_terms(
    config: ModelProbeConfig,
    last: dict[int, np.ndarray],
    mean: dict[int, np.ndarray],
    data: dict[int, np.ndarray],
) -> dict[int, float]:
    """The config's hidden logit term per layer, from Hugging Face's streams (no data: 0). The
    token read-out's term (its data_top parts as one token model) lands on its last layer."""
    want: dict[int, float] = {}
    tops = config.hidden_layers_at("data_top")
    for part in config.hidden or []:
        if part.position == "last":
            term = part.project(last[part.layer])
        elif part.position == "data_mean":
            term = part.project(mean[part.layer]) if part.layer in mean else 0.0
        else:
            term = config.data_top_term(data) if part.layer == tops[-1] else 0.0
        want[part.layer] = want.get(part.layer, 0.0) + term
    return want


def cached_and_chunked_passes(engine: Any) -> list[Any]:
    """The mixed batch twice: the first pass prefills in chunks, the second finds the prompts,
    data tokens included, in the prefix cache (so the memo supplies their streams); both
    passes' outputs."""
    assert {p.position for p in engine.config.hidden} == {"last", "data_mean", "data_top"}
    batch = mixed_batch()
    assert len(batch) >= 16
    first = engine.generate(batch, engine.sampling(max_tokens=2))
    second = engine.generate(batch, engine.sampling(max_tokens=2))
    assert sum(o.num_cached_tokens for o in second) > 0  # prefix cache in use
    assert max(len(o.prompt.token_ids) for o in first) > 128  # chunked prefill in use
    # the second pass served data tokens from the cache: the memo had to supply them
    assert any(
        o.num_cached_tokens > o.prompt.data_spans[0][0] for o in second if o.prompt.data_spans
    )
    return first + second


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
            got = np.asarray(probe.hidden_states[layer])
            np.testing.assert_allclose(got, last[layer], atol=5e-5, rtol=1e-5)
            if mean:
                got = np.asarray(probe.data_mean_states[layer])
                np.testing.assert_allclose(got, mean[layer], atol=5e-5, rtol=1e-5)
        want_terms = expected_terms(config, last, mean, data)
        assert probe.hidden == pytest.approx(want_terms, abs=5e-5)
        stats = hf_head_stats(
            str(model_dir), p.token_ids, p.instruction_spans, p.data_spans, config.heads
        )
        assert probe.focus == pytest.approx(config.focus(stats, want_terms), abs=5e-5)


def test_hidden_streams_and_terms_equal_hf_with_chunked_prefill_and_prefix_cache(
    engine: Any, tiny_llama_dir: Path
) -> None:
    check_against_hf(engine, tiny_llama_dir, cached_and_chunked_passes(engine))


def test_data_mean_reads_a_shared_document_from_the_prefix_cache(
    engine: Any, tiny_llama_dir: Path
) -> None:
    """Questions after one tool document: the first request computes the document; the others
    (sent in a later call) find it in the prefix cache and never recompute its tokens."""

    def chat(question: str) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Read the tool output."},
            {"role": "tool", "content": FILLER * 6 + ATTACK + " Shared document 7."},
            {"role": "user", "content": question},
        ]

    first = engine.generate([chat("Who was paid?")], engine.sampling(max_tokens=1))
    later = engine.generate(
        [chat(f"Question {i}: what was the amount?") for i in range(16)],
        engine.sampling(max_tokens=1),
    )
    for out in later:
        (_, end), *_ = out.prompt.data_spans
        assert out.num_cached_tokens >= end - 32  # the document's blocks came from the cache
    check_against_hf(engine, tiny_llama_dir, first + later)


def test_data_mean_reads_decoded_tokens_from_the_prefix_cache(
    engine: Any, tiny_llama_dir: Path
) -> None:
    check_against_hf(engine, tiny_llama_dir, [decoded_tokens_as_data(engine)])


def decoded_tokens_as_data(engine: Any) -> Any:
    """A request whose data are an earlier request's *decoded* tokens, found in the prefix
    cache: turn one decodes 48 tokens (on a GPU each decode step replays a full CUDA graph),
    turn two sends them back as the assistant's message (untrusted: a data span) and its prompt
    starts with turn one's prompt and decoded tokens, so their KV blocks (and their memo
    entries, written in the decode steps) are reused, never recomputed. Turn two's output."""
    tok = engine.tokenizer
    words = [tok.encode(w, add_special_tokens=False) for w in (" the", " a", " and", " of", " to")]
    allowed = [ids[0] for ids in words if len(ids) == 1]
    assert len(allowed) >= 2
    first_turn = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Write a few words."},
    ]
    params = engine.sampling(max_tokens=49, ignore_eos=True, allowed_token_ids=allowed)
    first = engine.generate([first_turn], params)[0]
    assert first.probe.error is None and len(first.token_ids) == 49
    reply = {"role": "assistant", "content": tok.decode(first.token_ids[:-1])}
    second = engine.generate(
        [[*first_turn, reply, {"role": "user", "content": "Go on."}]], engine.sampling(max_tokens=1)
    )[0]
    computed = first.prompt.token_ids + first.token_ids[:-1]  # the last one was never computed
    assert second.prompt.token_ids[: len(computed)] == computed
    (start, end), *_ = second.prompt.data_spans
    assert start <= len(first.prompt.token_ids) and end >= len(computed)
    # blocks written by decode steps came from the cache
    assert second.num_cached_tokens >= len(first.prompt.token_ids) + 16
    return second


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


def test_streams_at_asked_positions_equal_hf_from_chunks_and_the_prefix_cache(
    engine: Any, tiny_llama_dir: Path
) -> None:
    """Calibration's token read-out is fitted on whole streams at chosen prompt positions
    (``stream_positions``): for every request of the mixed batch, computed in chunks and then
    served from the prefix cache, they equal Hugging Face's at those positions; a request
    asking for a position outside its prompt fails alone."""
    batch = mixed_batch()
    prepared = [engine.prepare(r) for r in batch]
    positions = [sorted({0, len(p.token_ids) // 2, len(p.token_ids) - 1}) for p in prepared]
    bad = [*positions[:-1], [len(prepared[-1].token_ids)]]
    first = engine.score(batch, stream_positions=positions)
    second = engine.score(batch, stream_positions=bad)
    assert sum(o.num_cached_tokens for o in second) > 0
    assert "stream positions" in (second[-1].probe.error or "")
    for out, at in [*zip(first, positions, strict=True), *zip(second[:-1], bad, strict=False)]:
        assert out.probe.error is None, out.probe.error
        streams = hf_all_streams(str(tiny_llama_dir), tuple(out.prompt.token_ids))
        assert sorted(out.probe.token_states) == RAW_LAYERS
        for layer in RAW_LAYERS:
            got = out.probe.token_states[layer]
            assert got.shape == (len(at), 128)
            np.testing.assert_allclose(got, streams[layer][at], atol=5e-5, rtol=1e-5)
    assert all(not o.probe.token_states for o in engine.score(batch[:2]))


@lru_cache(maxsize=64)
def hf_all_streams(model_dir: str, token_ids: tuple[int, ...]) -> dict[int, np.ndarray]:
    """Every position's residual stream after each decoder layer (HF, float32, un-normed)."""
    model = _load(model_dir, torch.float32, "cpu")
    norm, model.model.norm = model.model.norm, torch.nn.Identity()
    try:
        with torch.no_grad():
            out = model(torch.tensor([list(token_ids)]), output_hidden_states=True)
    finally:
        model.model.norm = norm
    return {i: out.hidden_states[i + 1][0].double().numpy() for i in range(4)}
