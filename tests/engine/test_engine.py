"""The hooked engine against an independent reference: HF eager attention on the same weights.

Every request's per-head focus must equal the one read from ``output_attentions`` of
transformers' eager implementation, for a mixed batch with chunked prefill, sent twice so the
second pass reads the shared system prompt from vLLM's prefix cache.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from guardrail.errors import HeadsDoNotFitModelError, RequestError
from guardrail.probe.config import ModelProbeConfig
from tests.helpers import (
    SYSTEM,
    delay_pushed_results,
    hf_head_scores,
    hf_head_stats,
    mixed_batch,
    start_engine,
)


def assert_matches_reference(model_dir: Path, outputs, heads, atol=1e-4) -> None:
    for out in outputs:
        assert out.error is None and out.probe is not None
        assert out.probe.error is None, out.probe.error
        p = out.prompt
        ref = hf_head_scores(str(model_dir), p.token_ids, p.instruction_spans, p.data_spans, heads)
        worst = max(abs(ref[h] - out.probe.head_scores[h]) for h in heads)
        assert worst < atol, f"request {out.index}: max |vllm - hf| = {worst:.2e}"
        stats = hf_head_stats(str(model_dir), p.token_ids, p.instruction_spans, p.data_spans, heads)
        for h in heads:
            got, want = out.probe.head_stats[h], stats[h]
            np.testing.assert_allclose(got[:4], want[:4], atol=atol, rtol=0)
            # the entropy of the data share is ill-conditioned when almost no attention
            # reaches the data (float32 rounding of ~1e-9 weights): checked loosely there
            assert abs(got[4] - want[4]) < (atol if want[1] > 1e-3 else 0.05), (h, got, want)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_scores_equal_hf_eager_with_chunked_prefill_and_prefix_cache(model, request):
    engine = request.getfixturevalue(
        {"tiny_llama": "tiny_engine", "tiny_qwen2": "tiny_qwen2_engine"}[model]
    )
    model_dir = request.getfixturevalue(f"{model}_dir")
    batch = mixed_batch()
    lengths = [len(engine.prepare(r).token_ids) for r in batch]
    assert min(lengths) <= 16 and max(lengths) >= 700 and len(batch) >= 16
    first = engine.generate(batch, engine.sampling(max_tokens=2))
    second = engine.generate(batch, engine.sampling(max_tokens=2))
    # Second pass: the shared system prompt comes from the prefix cache (keys never recomputed).
    shared = [
        o for o, r in zip(second, batch, strict=True) if isinstance(r, tuple) and SYSTEM in r[0]
    ]
    assert all(o.num_cached_tokens >= 64 for o in shared)
    heads = list(engine.config.heads)
    assert_matches_reference(model_dir, first, heads)
    assert_matches_reference(model_dir, second, heads)
    for a, b in zip(first, second, strict=True):
        assert a.probe.focus == pytest.approx(b.probe.focus, abs=1e-5)


@pytest.mark.slow
def test_scores_equal_hf_eager_on_smollm2(smollm2_dir):
    heads = [(layer, head) for layer in (13, 15, 17, 19, 21) for head in range(9)]
    config = ModelProbeConfig(model_id="HuggingFaceTB/SmolLM2-135M-Instruct", heads=heads)
    engine = start_engine(smollm2_dir, multiprocess=True, probe_config=config)
    try:
        batch = mixed_batch()
        first = engine.generate(batch, engine.sampling(max_tokens=2))
        second = engine.generate(batch, engine.sampling(max_tokens=2))
        assert sum(o.num_cached_tokens for o in second) > 0
        assert_matches_reference(smollm2_dir, first, heads)
        assert_matches_reference(smollm2_dir, second, heads)
    finally:
        engine.close()


def test_multiprocess_engine_scores_equal_hf_eager(tiny_llama_dir):
    engine = start_engine(tiny_llama_dir, multiprocess=True)
    try:
        batch = mixed_batch()[::2]
        engine.generate(batch, engine.sampling(max_tokens=1))
        again = engine.generate(batch, engine.sampling(max_tokens=1))
        assert_matches_reference(tiny_llama_dir, again, list(engine.config.heads))
        # the scores came from the worker's pusher, across processes (not from pops)
        assert engine._inbox is not None and engine._inbox.received >= 2 * len(batch)
    finally:
        engine.close()


def test_results_are_pushed_and_popped_when_the_push_stops(tiny_engine):
    """Results reach the caller pushed by the worker; with the push stopped (as for a worker
    that cannot reach the caller) they are popped, with the same scores."""
    from guardrail.protocol import RPC_PUSH_RESULTS

    inbox = tiny_engine._inbox
    assert inbox is not None
    batch = mixed_batch()[:6]
    received = inbox.received
    pushed = tiny_engine.generate(batch, tiny_engine.sampling(max_tokens=1))
    assert inbox.received - received == len(batch)
    tiny_engine.llm.collective_rpc(RPC_PUSH_RESULTS, args=(None, ""))
    try:
        received = inbox.received
        popped = tiny_engine.generate(batch, tiny_engine.sampling(max_tokens=1))
        assert inbox.received == received  # nothing pushed: every score was popped
    finally:
        assert tiny_engine.llm.collective_rpc(RPC_PUSH_RESULTS, args=inbox.push_args)[0]
    for a, b in zip(pushed, popped, strict=True):
        assert a.probe.error is None and b.probe.error is None
        assert a.probe.focus == pytest.approx(b.probe.focus, abs=1e-6)
    received = inbox.received
    tiny_engine.generate(batch[:2], tiny_engine.sampling(max_tokens=1))
    assert inbox.received - received == 2  # pushing again


def test_a_pushed_result_slower_than_the_wait_is_waited_for_not_missing(tiny_engine, monkeypatch):
    """A step's results that take longer to reach the caller than it waits before popping (the
    streams calibration reads at the 8B shape: hundreds of MB a step, which once came back as
    "missing" on an H100) are still the request's: the pop says the worker's pusher took them,
    and the caller waits for them on its socket."""
    from guardrail.engine.inbox import PUSH_WAIT_S

    inbox = tiny_engine._inbox
    assert inbox is not None
    batch = mixed_batch()[:3]
    fast = tiny_engine.generate(batch, tiny_engine.sampling(max_tokens=1))
    # longer than the wait before the pop and the old wait after it
    delay_pushed_results(inbox, monkeypatch, 4 * PUSH_WAIT_S)
    received = inbox.received
    slow = tiny_engine.generate(batch, tiny_engine.sampling(max_tokens=1))
    assert inbox.received - received == len(batch)  # they came pushed, late
    for a, b in zip(fast, slow, strict=True):
        assert b.probe.error is None, b.probe.error
        assert b.probe.focus == pytest.approx(a.probe.focus, abs=1e-6)


def test_probe_does_not_change_generated_text(tiny_engine):
    """The same prompts with and without the probe, in one batch, decode the same tokens."""
    from vllm.inputs import TokensPrompt

    batch = mixed_batch()[:8]
    prepared = [tiny_engine.prepare(r) for r in batch]
    params = tiny_engine.sampling(max_tokens=12, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p.token_ids) for p in prepared] * 2
    all_params = [
        tiny_engine.probe.attach(params, tiny_engine.probe.spec(p, f"same-batch-{i}", params))
        for i, p in enumerate(prepared)
    ] + [params] * len(prepared)
    outs = tiny_engine.llm.generate(prompts, all_params, use_tqdm=False)
    probed, plain = outs[: len(prepared)], outs[len(prepared) :]
    for a, b in zip(probed, plain, strict=True):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        assert len(a.outputs[0].token_ids) == 12
    results = tiny_engine.llm.collective_rpc(
        "guardrail_pop_results", args=([f"same-batch-{i}" for i in range(len(prepared))],)
    )[0]
    assert len(results["results"]) == len(prepared)  # the probed half really was probed


def test_one_bad_request_fails_alone(tiny_engine):
    too_long = ("Summarize.", "word " * 5000)
    outs = tiny_engine.generate(["", ("Summarize.", "short text"), too_long, "Hello"])
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert isinstance(outs[0].error, RequestError) and "empty prompt" in str(outs[0].error)
    assert isinstance(outs[2].error, RequestError) and "max_model_len" in str(outs[2].error)
    for good in (outs[1], outs[3]):
        assert good.error is None and good.probe.error is None and good.token_ids


def test_generate_enqueues_each_render_group_as_it_is_rendered(tiny_engine):
    """Requests reach the engine a render group at a time, each group as soon as it is
    rendered (the engine starts on the first while the rest render); a bad request in the
    middle fails alone and order is kept."""
    llm = tiny_engine.llm
    batch: list[object] = [("Translate to French.", f"Good morning, table {i}.") for i in range(30)]
    batch.insert(5, "")  # refused: never enqueued
    lengths = [len(tiny_engine.prepare(r).token_ids) for r in batch if r]
    sizes: list[list[int]] = []
    rendered, rendered_before = [0], []  # requests rendered so far, and when each was enqueued
    real_enqueue, real_prepare_many = llm.enqueue, tiny_engine.prepare_many

    def recording_enqueue(prompts, *args, **kwargs):
        sizes.append([len(p["prompt_token_ids"]) for p in prompts])
        rendered_before.append(rendered[0])
        return real_enqueue(prompts, *args, **kwargs)

    def counting_prepare_many(requests):
        rendered[0] += len(requests)
        return real_prepare_many(requests)

    llm.enqueue, tiny_engine.prepare_many = recording_enqueue, counting_prepare_many
    try:
        outs = tiny_engine.generate(batch, tiny_engine.sampling(max_tokens=2))
    finally:
        llm.enqueue = real_enqueue
        del tiny_engine.prepare_many
    assert [o.index for o in outs] == list(range(len(batch)))
    assert isinstance(outs[5].error, RequestError)
    good = [o for o in outs if o.index != 5]
    assert all(o.error is None and o.probe.error is None for o in good)
    assert [n for s in sizes for n in s] == lengths  # every good request once, in order
    assert tiny_engine.render_group == 8 and [len(s) for s in sizes] == [7, 8, 8, 7]  # "" first
    assert rendered_before == [8, 16, 24, 31]


def test_early_stop_ends_the_request_after_prefill(tiny_engine):
    batch = mixed_batch()[:10]
    params = tiny_engine.sampling(max_tokens=16)
    baseline = tiny_engine.generate(batch, params)
    focus = sorted(o.probe.focus for o in baseline)
    cut = (focus[4] + focus[5]) / 2  # half the batch below, half above
    outs = tiny_engine.generate(batch, params, stop_below=cut)
    for base, out in zip(baseline, outs, strict=True):
        assert out.probe.focus == pytest.approx(base.probe.focus, abs=1e-5)
        if base.probe.focus <= cut:
            assert out.probe.stopped and len(out.token_ids) == 1 and out.finish_reason == "stop"
        else:
            assert not out.probe.stopped and out.token_ids == base.token_ids


def test_heads_that_do_not_fit_are_refused_before_start(tiny_llama_dir):
    bad = ModelProbeConfig(model_id="tiny", heads=[(0, 0), (7, 1)])
    with pytest.raises(HeadsDoNotFitModelError, match="4 layers x 4 heads"):
        start_engine(tiny_llama_dir, probe_config=bad)


@pytest.mark.slow
def test_probe_fires_in_vllms_default_compiled_mode(tiny_llama_dir, tiny_engine):
    """Without enforce_eager the attention implementation still runs as Python: scores match."""
    engine = start_engine(tiny_llama_dir, multiprocess=True, enforce_eager=False)
    try:
        assert engine.model_info["compilation_mode"] != "CompilationMode.NONE"
        batch = mixed_batch()[:6]
        compiled = engine.generate(batch, engine.sampling(max_tokens=1))
        eager = tiny_engine.generate(batch, tiny_engine.sampling(max_tokens=1))
        for a, b in zip(compiled, eager, strict=True):
            assert a.probe.error is None
            assert a.probe.focus == pytest.approx(b.probe.focus, abs=1e-4)
    finally:
        engine.close()
