"""Steering inside the real engine (tiny Llama, eager, in-process), against references.

- Per request: in a batch mixing steered and unsteered requests, unsteered rows are
  bit-identical to an all-unsteered run (token ids and log-probabilities, greedy).
- Parity: steered log-probabilities equal Hugging Face's on the same weights with the same
  steering applied to the layer output (the full residual stream) at every position.
- Removing a vector restores the baseline exactly; prefix caching never mixes steered and
  unsteered KV blocks (``cache_salt``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from guardrail.engine import SteeringClient
from guardrail.errors import ConfigError, EngineNotGuardableError
from guardrail.steering import SteeringVector, steering_delta
from tests.helpers import FILLER, SYSTEM, _load, random_vector

LAYER = 1
REQUESTS = [
    ("Summarize the email.", "Hi Bob, lunch at noon? " + FILLER),
    ("Translate to French.", "Good morning"),
    (SYSTEM, FILLER * 6),  # ~500 tokens: chunked prefill (max_num_batched_tokens=128)
    "Hello there",
]


def _run(engine, steering=None, max_tokens=6):
    """Greedy outputs with the prefix cache emptied first, so every run schedules alike."""
    engine.llm.reset_prefix_cache()
    params = engine.sampling(max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    return engine.generate(REQUESTS, params, steering=steering)


def test_only_steered_rows_change_in_a_mixed_batch(tiny_engine):
    baseline = _run(tiny_engine)
    with (
        tiny_engine.steering_vector(random_vector(tiny_engine)) as add,
        tiny_engine.steering_vector(random_vector(tiny_engine, "proj", "adjust_rs", 1.0)) as proj,
    ):
        mixed = _run(tiny_engine, steering=[add.name, None, proj.name, None])
    for i in (1, 3):  # unsteered: identical tokens and bit-identical focus
        assert mixed[i].steering is None
        assert mixed[i].token_ids == baseline[i].token_ids
        assert mixed[i].probe.focus == baseline[i].probe.focus
    for i in (0, 2):
        report = mixed[i].steering
        assert report is not None and report.error is None
        expected = len(mixed[i].prompt.token_ids) + len(mixed[i].token_ids) - 1
        assert report.tokens_steered == expected  # every prefill chunk and decode step
        assert mixed[i].token_ids != baseline[i].token_ids
        # layer-1 steering moves the attention of later layers, so the focus moves too
        assert mixed[i].probe.focus != pytest.approx(baseline[i].probe.focus, abs=1e-6)


def test_removing_steering_restores_the_baseline_exactly(tiny_engine):
    baseline = _run(tiny_engine)
    vector = random_vector(tiny_engine)
    with tiny_engine.steering_vector(vector):
        steered = _run(tiny_engine, steering=vector.name)
        unsteered_while_loaded = _run(tiny_engine)
    after = _run(tiny_engine)
    assert all(s.token_ids != b.token_ids for s, b in zip(steered, baseline, strict=True))
    for runs in (unsteered_while_loaded, after):
        assert [o.token_ids for o in runs] == [o.token_ids for o in baseline]
        assert [o.probe.focus for o in runs] == [o.probe.focus for o in baseline]
    assert tiny_engine.steering_vectors == {}
    assert tiny_engine.llm.collective_rpc("guardrail_unload_steering", args=([],)) == [[]]
    with pytest.raises(ConfigError, match="not loaded"):
        tiny_engine.generate(REQUESTS[:1], steering=vector.name)


def test_requests_steered_alike_in_one_step_equal_each_steered_alone(tiny_engine):
    """One group (the same vector for every request, one of them in chunked prefill) steered
    with one gather and one ``index_add`` per layer: each request's tokens and log-probabilities
    equal its own run steered alone, and each report counts its own tokens."""
    vector = random_vector(tiny_engine, "alike", "adjust_rs", 1.0)
    with tiny_engine.steering_vector(vector):
        together = _run(tiny_engine, steering=vector.name)
        alone = []
        for request in REQUESTS:
            tiny_engine.llm.reset_prefix_cache()
            params = tiny_engine.sampling(max_tokens=6, ignore_eos=True, logprobs=3)
            alone.append(tiny_engine.generate([request], params, steering=vector.name)[0])
    for batched, single in zip(together, alone, strict=True):
        assert batched.token_ids == single.token_ids
        assert batched.logprobs is not None and single.logprobs is not None
        for a, b in zip(batched.logprobs, single.logprobs, strict=True):
            assert a[0].token_id == b[0].token_id  # the generated token comes first
            assert a[0].logprob == pytest.approx(b[0].logprob, abs=1e-4)
        steered = len(batched.prompt.token_ids) + len(batched.token_ids) - 1
        assert batched.steering.tokens_steered == single.steering.tokens_steered == steered


def _hf_steered_logprobs(model_dir: Path, token_ids: list[int], vector: SteeringVector, method):
    """Log-probabilities of the next token at every position, from HF with the same steering
    applied to the output of decoder layer LAYER (HF returns the full residual stream)."""
    model = _load(str(model_dir))
    meta = vector.metadata

    def hook(module, args, output):
        stream = output[0] if isinstance(output, tuple) else output
        delta = steering_delta(stream[0], vector.direction, method, meta.coefficient, meta.avg_proj)
        steered = stream + delta.unsqueeze(0)
        return (steered, *output[1:]) if isinstance(output, tuple) else steered

    handle = model.model.layers[LAYER].register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([token_ids])).logits[0]
    finally:
        handle.remove()
    return torch.log_softmax(logits.double(), dim=-1)


@pytest.mark.parametrize("method", ["add_vector", "adjust_rs"])
def test_steered_logprobs_equal_hf_reference(tiny_engine, tiny_llama_dir, method):
    vector = random_vector(
        tiny_engine, method=method, coefficient=6.0 if method == "add_vector" else 1
    )
    request = REQUESTS[2]  # chunked prefill: steering must cover every chunk
    with tiny_engine.steering_vector(vector):
        params = tiny_engine.sampling(max_tokens=4, ignore_eos=True, logprobs=1)
        prepared = tiny_engine.prepare(request)
        from vllm.inputs import TokensPrompt

        resolved = tiny_engine.steering.plan(vector.name, 1)[0]
        prompt = TokensPrompt(prompt_token_ids=prepared.token_ids, cache_salt="parity-" + method)
        params.extra_args = {"guardrail_steer": resolved.spec(f"parity-{method}")}
        result = tiny_engine.llm.generate([prompt], [params], use_tqdm=False)[0]
        tiny_engine.steering.reports({f"parity-{method}": resolved})  # drop the report
    generated = list(result.outputs[0].token_ids)
    ref = _hf_steered_logprobs(
        tiny_llama_dir, prepared.token_ids + generated[:-1], vector, vector.metadata.method
    )
    n, logprobs_per_step = len(prepared.token_ids), result.outputs[0].logprobs
    for step, (token, logprobs) in enumerate(zip(generated, logprobs_per_step, strict=True)):
        assert logprobs[token].logprob == pytest.approx(float(ref[n - 1 + step, token]), abs=2e-4)
        assert int(ref[n - 1 + step].argmax()) == token


def test_steered_requests_never_reuse_unsteered_cache(tiny_engine):
    vector = random_vector(tiny_engine)
    request = [REQUESTS[2]]
    params = tiny_engine.sampling(max_tokens=6, ignore_eos=True)
    tiny_engine.llm.reset_prefix_cache()
    tiny_engine.generate(request, params)
    cached = tiny_engine.generate(request, params)[0]
    assert cached.num_cached_tokens >= 256  # the unsteered prefix is in the cache
    with tiny_engine.steering_vector(vector):
        steered = tiny_engine.generate(request, params, steering=vector.name)[0]
        again = tiny_engine.generate(request, params, steering=vector.name)[0]
        stronger = tiny_engine.generate(
            request, params, steering={"vector": vector.name, "coefficient": 9.0}
        )[0]
    assert steered.num_cached_tokens == 0  # salted: the unsteered blocks are not reused
    assert steered.token_ids != cached.token_ids
    assert steered.steering.tokens_steered == len(steered.prompt.token_ids) + 5
    # the same steering shares its own cached blocks, and gives the same output
    assert again.num_cached_tokens >= 256 and again.token_ids == steered.token_ids
    assert (
        again.steering.tokens_steered == len(again.prompt.token_ids) - again.num_cached_tokens + 5
    )
    assert stronger.num_cached_tokens == 0  # another coefficient is another salt


def test_worker_side_failure_is_reported_not_silent(tiny_engine):
    vector, other = random_vector(tiny_engine), random_vector(tiny_engine, name="other")
    with tiny_engine.steering_vector(vector), tiny_engine.steering_vector(other):
        # the worker forgets a vector behind the engine's back; the layer stays hooked
        tiny_engine.llm.collective_rpc("guardrail_unload_steering", args=([vector.name],))
        out = tiny_engine.generate(REQUESTS[:2], steering=[vector.name, None])
        # with no vector left on the layer its hook is removed: nothing fires at all
        tiny_engine.llm.collective_rpc("guardrail_unload_steering", args=([other.name],))
        unhooked = tiny_engine.generate(REQUESTS[:1], steering=other.name)[0]
    assert "not loaded in the worker" in out[0].steering.error
    assert out[0].steering.tokens_steered == 0
    assert out[1].steering is None and out[1].probe.error is None
    assert "did not fire" in unhooked.steering.error


def test_capture_equals_hf_hidden_states(tiny_engine, tiny_llama_dir):
    requests = REQUESTS[:3]
    captured = tiny_engine.capture_residuals(requests, [0, LAYER, 3])
    model = _load(str(tiny_llama_dir))
    for request, streams in zip(requests, captured, strict=True):
        ids = tiny_engine.prepare(request).token_ids
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        for layer in (0, LAYER):  # hidden_states[L + 1] is the stream after layer L
            torch.testing.assert_close(streams[layer], hidden[layer + 1][0, -1], atol=1e-4, rtol=0)
        assert set(streams) == {0, LAYER, 3}


def test_vectors_for_another_model_or_a_compiled_engine_are_refused(tiny_engine):
    wrong = SteeringVector(
        random_vector(tiny_engine).metadata.model_copy(update={"model_id": "org/other"}),
        random_vector(tiny_engine).direction,
    )
    with pytest.raises(ConfigError, match="does not fit the served model"):
        tiny_engine.load_steering_vector(wrong)
    # The steering component of a compiled engine, with no vLLM behind it: no call may happen.
    info = {**tiny_engine.model_info, "enforce_eager": False}
    compiled = SteeringClient(None, tiny_engine.config.model_id, info, tiny_engine.prepare)
    with pytest.raises(EngineNotGuardableError, match="enforce_eager=True"):
        compiled.load(random_vector(tiny_engine))
    with pytest.raises(EngineNotGuardableError, match="enforce_eager=True"):
        compiled.plan("rand", 1)
