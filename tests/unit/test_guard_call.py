"""``GuardedCall``, the one implementation of a guard call that both guards run: raise-on-block,
the engine call's arguments, results in request order, and fail-closed on a dead engine. Pure
parts are tested on synthetic verdicts; the call itself over ``FakeEngine`` (no vLLM)."""

from __future__ import annotations

from pathlib import Path

import pytest

from guardrail.errors import EngineDeadError, PromptInjectionBlocked, RequestError
from guardrail.guard.call import EngineBatch, GuardedCall, raise_if_blocked
from guardrail.guard.decider import Decider, GuardedResult
from guardrail.guard.settings import GuardSettings
from guardrail.policy import Action
from guardrail.policy.verdict import Verdict
from guardrail.probe.config import ModelProbeConfig
from guardrail.testing import FakeEngine

CONFIG = ModelProbeConfig(model_id="tiny", heads=[(0, 0)], threshold=0.5)


def _result(request_id: str, action: Action) -> GuardedResult:
    verdict = Verdict(request_id=request_id, action=action, reason=f"{request_id} is {action}")
    return GuardedResult(index=0, request_id=request_id, verdict=verdict)


def test_raise_if_blocked_raises_only_when_asked_and_keeps_every_result() -> None:
    results = [_result("a", Action.ALLOW), _result("b", Action.BLOCK), _result("c", Action.BLOCK)]
    raise_if_blocked(results, "refuse")  # refusing: the results are the answer
    raise_if_blocked(results[:1], "raise")  # nothing blocked
    with pytest.raises(PromptInjectionBlocked, match=r"2 of 3 request.*first: request b") as info:
        raise_if_blocked(results, "raise")
    assert info.value.verdict is results[1].verdict and info.value.results == results


def test_one_blocked_request_is_named_alone() -> None:
    with pytest.raises(PromptInjectionBlocked, match=r"^request s blocked: s is ") as info:
        raise_if_blocked([_result("s", Action.BLOCK)], "raise")
    assert info.value.results is not None and len(info.value.results) == 1


def test_a_batch_submits_its_arguments_as_the_engine_takes_them() -> None:
    batch = EngineBatch([1], ["r"], None, [0.5], [True], ["k"])
    seen = batch.submit(lambda *args, **kwargs: (args, kwargs), steering=["v"])
    assert seen == (
        (["r"], None),
        {
            "stop_below": [0.5],
            "stop_on_probe_error": [True],
            "probe_keys": ["k"],
            "steering": ["v"],
        },
    )


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> FakeEngine:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    return FakeEngine(
        CONFIG, tokenizer, lambda prompt, attempt: 0.2 if "attack" in prompt.text else 0.9
    )


def test_a_call_answers_in_order_and_fails_a_bad_entry_alone(engine: FakeEngine) -> None:
    from vllm import SamplingParams

    decider = Decider(CONFIG, [{"threshold": 0.5}], GuardSettings(on_block="raise"))
    requests = [("Summarize.", "hello"), ("Summarize.", "attack"), ("Summarize.", "hi")]
    params = [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4), None]
    call = GuardedCall(decider, engine, requests, params, ["x", None, "z"])
    call.resolve(None, prepare=None)
    assert call.send == [0, 1] and isinstance(call.errors[2], RequestError)
    batch = call.batch(call.send)
    assert batch.probe_keys[0] == "x" and batch.stop_below == [0.5, 0.5]  # blocked in-engine
    assert call.batch([1], attempt=2).probe_keys == [f"{call.ids[1]}~attempt2"]
    results = call.results(batch.submit(engine.generate))
    assert [r.index for r in results] == [0, 1, 2]
    assert results[0].verdict is not None and results[0].verdict.action is Action.ALLOW
    assert results[1].blocked and results[2].error is call.errors[2]
    with pytest.raises(PromptInjectionBlocked) as info:
        call.finish(results)
    assert info.value.results == results


def test_a_dead_engine_fails_every_sent_request_closed(engine: FakeEngine) -> None:
    call = GuardedCall(Decider(CONFIG), engine, [("Do.", "a"), ("Do.", "b")], None, None)
    call.resolve(None, prepare=None)
    error = EngineDeadError("the engine died")
    call.fail(error)
    assert error.results is not None and [r.blocked for r in error.results] == [True, True]
    assert all(r.error is error and r.text == "" for r in error.results)
