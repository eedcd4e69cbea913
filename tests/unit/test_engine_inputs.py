"""Per-request arguments, the engine handle and the guard on a dead engine, without vLLM running.

- Per-request lists (sampling params, ``stop_below``, ``stop_on_probe_error``, probe keys): a
  bad entry fails its own request with a ``RequestError`` naming the index; one bad value for
  every request fails the call with a ``ConfigError``.
- ``EngineHandle`` (guardrail.engine.engine_process) serialises calls from many threads, refuses a
  closed engine, turns vLLM's ``EngineDeadError`` into this library's, and closes once.
- ``GuardedLLM`` over a ``FakeEngine`` that dies: every request of the batch gets a fail-closed
  verdict carried by the raised ``EngineDeadError``, recorded in the metrics.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from guardrail.engine.client import ProbeClient, checked_probe_keys
from guardrail.engine.engine_process import EngineHandle
from guardrail.engine.types import STOP_IS, is_stop_value, per_request_checked
from guardrail.errors import (
    ConfigError,
    EngineClosedError,
    EngineDeadError,
    GuardrailError,
    RequestError,
)
from guardrail.guard import GuardedLLM
from guardrail.metrics import GuardrailMetrics
from guardrail.policy import Action, FailureMode
from guardrail.probe.config import ModelProbeConfig
from guardrail.probe.scoring import ATTENTION_STATS
from guardrail.protocol import PoppedResults, ProbeErrorReason
from guardrail.testing import FakeEngine

CONFIG = ModelProbeConfig(model_id="tiny", heads=[(0, 0)], threshold=0.5)


# -- per-request arguments ----------------------------------------------------------------------
def test_a_bad_entry_fails_its_request_and_a_bad_single_value_fails_the_call() -> None:
    errors: dict[int, GuardrailError] = {}
    values = [None, 0.2, float("nan"), "0.3", True, 1]
    checked = per_request_checked(values, 6, "stop_below", is_stop_value, STOP_IS, errors)
    assert checked == [None, 0.2, None, None, None, 1]
    assert sorted(errors) == [2, 3, 4]
    assert all(isinstance(e, RequestError) for e in errors.values())
    assert str(errors[3]).startswith("request 3: stop_below must be None or a finite number")
    with pytest.raises(ConfigError, match="stop_below must be None or a finite number"):
        per_request_checked(float("inf"), 2, "stop_below", is_stop_value, STOP_IS, {})
    with pytest.raises(ConfigError, match="got 1 values of stop_below for 2 requests"):
        per_request_checked([0.1], 2, "stop_below", is_stop_value, STOP_IS, {})
    # An earlier error of the same request wins.
    errors = {0: RequestError("first")}
    per_request_checked(["x"], 1, "stop_below", is_stop_value, STOP_IS, errors)
    assert str(errors[0]) == "first"


def test_probe_keys_are_checked_per_request() -> None:
    errors: dict[int, GuardrailError] = {}
    keys = checked_probe_keys(["a", None, 7, "a", "", "b"], 6, errors)
    assert keys == ["a", None, None, None, None, "b"]
    assert sorted(errors) == [2, 3, 4]
    assert "used twice" in str(errors[3]) and "non-empty string" in str(errors[2])
    with pytest.raises(ConfigError, match="must be a list"):
        checked_probe_keys("abc", 3, {})  # type: ignore[arg-type]
    assert checked_probe_keys(None, 2, {}) == [None, None]


# -- the engine handle --------------------------------------------------------------------------
class _SlowLLM:
    """Stands in for ``vllm.LLM``: records how many calls overlap."""

    def __init__(self) -> None:
        self.active = 0
        self.most = 0
        self.calls: list[tuple[str, int]] = []
        self.fail_with: BaseException | None = None

    def generate(self, tag: str, index: int) -> tuple[str, int]:
        self.active += 1
        self.most = max(self.most, self.active)
        time.sleep(0.002)
        self.calls.append((tag, index))
        self.active -= 1
        if self.fail_with is not None:
            raise self.fail_with
        return tag, index


def test_the_handle_runs_one_call_at_a_time_and_each_caller_gets_its_own_answer() -> None:
    handle = EngineHandle()
    handle.llm = fake = _SlowLLM()
    handle.watch()  # no engine processes: the supervisor is inert
    assert handle.supervisor is not None and handle.supervisor.pids == []
    answers: dict[str, list[Any]] = {}

    def caller(tag: str) -> None:
        got = []
        for i in range(20):
            with handle.call() as llm:
                got.append(llm.generate(tag, i))
        answers[tag] = got

    threads = [threading.Thread(target=caller, args=(f"t{k}",)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fake.most == 1 and len(fake.calls) == 160
    assert answers == {f"t{k}": [(f"t{k}", i) for i in range(20)] for k in range(8)}


def test_the_handle_reports_dead_and_closed_engines_with_its_own_errors() -> None:
    from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

    handle = EngineHandle()
    handle.llm = fake = _SlowLLM()
    handle.watch()
    fake.fail_with = VllmEngineDeadError()
    with (
        pytest.raises(EngineDeadError, match="died during the call") as caught,
        handle.call() as llm,
    ):
        llm.generate("x", 0)
    assert isinstance(caught.value.__cause__, VllmEngineDeadError)
    fake.fail_with = ValueError("an ordinary error")  # not a death: passes through unchanged
    with pytest.raises(ValueError, match="an ordinary error"), handle.call() as llm:
        llm.generate("x", 1)
    handle.close()
    handle.close()  # idempotent
    with pytest.raises(EngineClosedError, match="closed"), handle.call():
        pass
    assert issubclass(EngineClosedError, EngineDeadError)


# -- the guard on a dead engine -----------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


class _DyingEngine(FakeEngine):
    """A fake engine whose engine dies on the ``die_on``-th generate call."""

    die_on = 1

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        if len(self.calls) + 1 >= self.die_on:
            self.calls.append([])
            raise EngineDeadError("the engine died during the call (test)")
        return super().generate(*args, **kwargs)


def test_a_dead_engine_fails_every_request_closed_and_counts_them(tokenizer: Any) -> None:
    registry = CollectorRegistry()
    metrics = GuardrailMetrics(registry, model_name="tiny")
    engine = _DyingEngine(CONFIG, tokenizer, lambda prompt, attempt: 0.9)
    guard = GuardedLLM.from_engine(engine, metrics=metrics)
    requests = [("Summarize.", "hello"), "Hi", ("Translate.", "bonjour")]
    params = [object(), None, object()]  # None: request "b" is invalid, never sent
    with pytest.raises(EngineDeadError, match="died") as caught:
        guard.generate(requests, params, request_ids=["a", "b", "c"])
    results = caught.value.results
    assert [r.request_id for r in results] == ["a", "b", "c"]
    invalid = results[1]
    assert isinstance(invalid.error, RequestError) and invalid.verdict is None
    for lost in (results[0], results[2]):
        assert lost.verdict is not None and lost.verdict.blocked
        assert lost.verdict.failure is FailureMode.FAIL_CLOSED
        assert lost.verdict.probe_error_reason is ProbeErrorReason.ENGINE
        assert "died during the call" in (lost.verdict.probe_error or "")
        assert lost.text == "" and lost.token_ids == () and lost.error is caught.value
        assert not lost.ok
    value = registry.get_sample_value
    model = {"model_name": "tiny"}
    assert value("guardrail_requests_total", {**model, "action": "block"}) == 2
    assert value("guardrail_requests_total", {**model, "action": "allow"}) == 0
    assert value("guardrail_probe_errors_total", {**model, "reason": "engine"}) == 2
    assert (
        value("guardrail_probe_errors_total", {"model_name": "other", "reason": "engine"}) is None
    )
    assert value("guardrail_requests_in_flight", model) == 0


def test_a_death_during_the_retry_pass_loses_the_whole_batch(tokenizer: Any) -> None:
    from guardrail.policy import PromptInjectionPolicy, RetrySettings
    from guardrail.steering import SteeringMetadata, SteeringVector

    engine = _DyingEngine(CONFIG, tokenizer, lambda prompt, attempt: 0.3)
    engine.die_on = 2  # the first pass answers; the steered retry pass dies
    meta = SteeringMetadata(
        name="vec", model_id="tiny", layer=1, num_layers=4, hidden_size=64, avg_proj=1.0
    )
    import torch

    engine.load_steering_vector(SteeringVector(meta, torch.ones(64) / 8.0))
    retry = PromptInjectionPolicy(
        action=Action.RETRY_WITH_STEERING, retry=RetrySettings(vector="vec", max_attempts=2)
    )
    guard = GuardedLLM.from_engine(engine, [retry])
    with pytest.raises(EngineDeadError) as caught:
        guard.generate([("Summarize.", "hello")])
    (lost,) = caught.value.results
    assert lost.verdict is not None and lost.verdict.blocked and lost.text == ""


def test_none_in_a_sampling_params_list_fails_that_request_alone(tokenizer: Any) -> None:
    engine = FakeEngine(CONFIG, tokenizer, lambda prompt, attempt: 0.9)
    guard = GuardedLLM.from_engine(engine)
    ok, bad = guard.generate(["Hi", "Hello"], [object(), None])
    assert ok.verdict is not None and ok.verdict.action is Action.ALLOW
    assert isinstance(bad.error, RequestError) and bad.verdict is None
    assert str(bad.error).startswith("request 1: its sampling params are None")
    assert len(engine.calls[-1]) == 1  # the bad one was never sent


def test_a_self_test_that_could_not_be_rendered_names_the_chat_template(tiny_llama_dir) -> None:
    """A model directory without a chat template fails the start-up self-test with an error
    that says so (not the captured-graph advice, which is for a probe that did not fire)."""
    from transformers import AutoTokenizer

    from guardrail.engine.install import SELF_TEST_REQUEST, check_self_test
    from guardrail.engine.types import GuardedOutput
    from guardrail.errors import EngineNotGuardableError, RequestError
    from guardrail.probe.prompts import prepare_prompt

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    tokenizer.chat_template = None
    with pytest.raises(RequestError) as refused:
        prepare_prompt(SELF_TEST_REQUEST, tokenizer)
    needs = r"needs one \(chat_template\.jinja"
    with pytest.raises(EngineNotGuardableError, match=needs) as failed:
        check_self_test(GuardedOutput(index=0, prompt=None, error=refused.value))
    assert "captured graph" not in str(failed.value)


def test_engine_commands_take_any_vllm_argument() -> None:
    """``--engine-arg KEY=VALUE`` on every engine command: JSON values parsed, text kept."""
    from guardrail.cli import build_parser

    args = build_parser().parse_args(
        [
            "calibrate",
            "--data",
            "rows.jsonl",
            "--out",
            "configs",
            "--engine-arg",
            "gpu_memory_utilization=0.8",
            "--engine-arg",
            "enforce-eager=false",
            "--engine-arg",
            "attention_backend=FLASH_ATTN",
        ]
    )
    assert args.engine_arg == [
        ("gpu_memory_utilization", 0.8),
        ("enforce_eager", False),
        ("attention_backend", "FLASH_ATTN"),
    ]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["check", "--engine-arg", "no-equals-sign"])


# -- probe error reasons -------------------------------------------------------------------------
def _popped(**results: Any) -> PoppedResults:
    return {"heads": [[0, 0]], "results": results}


def test_the_client_takes_the_workers_reason_and_names_its_own() -> None:
    client = ProbeClient(CONFIG, tp_size=1, stop_token=None)
    stats = np.full(len(ATTENTION_STATS), 0.5).tobytes()  # float64, as the worker sends them
    ranks = [
        _popped(
            ok={"num_prompt_tokens": 4, "probe_seconds": 0.0, "stats": stats},
            failed={
                "num_prompt_tokens": 4,
                "probe_seconds": 0.0,
                "error": "reworded: nothing here says hidden",
                "reason": "hidden",
            },
            bare={"num_prompt_tokens": 4, "probe_seconds": 0.0, "error": "hidden: no reason"},
        )
    ]
    assert client.result(ranks, "ok").error_reason is None
    failed = client.result(ranks, "failed")
    assert failed.focus is None and failed.error == "reworded: nothing here says hidden"
    assert failed.error_reason is ProbeErrorReason.HIDDEN
    assert client.result(ranks, "bare").error_reason is ProbeErrorReason.OTHER  # never parsed
    assert client.result(ranks, "absent").error_reason is ProbeErrorReason.MISSING
    other_heads = ProbeClient(
        ModelProbeConfig(model_id="tiny", heads=[(0, 0), (1, 0)], threshold=0.5),
        tp_size=1,
        stop_token=None,
    )
    assert other_heads.result(ranks, "ok").error_reason is ProbeErrorReason.INCOMPLETE


def test_the_fake_engine_fails_with_the_real_engines_reasons(tokenizer: Any) -> None:
    engine = FakeEngine(CONFIG, tokenizer, lambda p, attempt: None if "zzq" in p.text else 0.9)
    engine.set_probe_faults(["fault"])
    requests = [("Summarize.", "hello"), ("Summarize.", "hello"), ("Summarize.", "zzq")]
    fault, ok, unscored = engine.generate(requests, probe_keys=["fault", "ok", "none"])
    assert fault.probe is not None and ok.probe is not None and unscored.probe is not None
    assert fault.probe.error_reason is ProbeErrorReason.LAYER  # the worker fails a hooked layer
    assert ok.probe.error is None and ok.probe.error_reason is None
    assert unscored.probe.error_reason is ProbeErrorReason.MISSING


def test_the_fake_engine_refuses_bad_entries_as_the_real_engine_does(tokenizer: Any) -> None:
    """One validation for both engines: a bad probe key or stop value fails its own request
    with the error ``per_request_args`` gives it, the others are answered; a bad single value
    fails the call."""
    from guardrail.engine.client import per_request_args

    engine = FakeEngine(CONFIG, tokenizer, lambda p, attempt: 0.9)
    requests = [("Summarize.", "hello")] * 4
    keys = ["a", "a", "", None]
    stops = [0.5, None, 0.5, "low"]
    outs = engine.generate(requests, probe_keys=keys, stop_below=stops)
    real = per_request_args(requests, None, stops, True, keys, lambda: None).errors
    assert sorted(real) == [1, 2, 3]
    assert [o.error is None for o in outs] == [True, False, False, False]
    for i in real:
        assert type(outs[i].error) is type(real[i]) and str(outs[i].error) == str(real[i])
    assert outs[0].probe is not None and outs[0].probe.focus == 0.9
    with pytest.raises(ConfigError, match="probe_keys must be a list"):
        engine.generate(requests, probe_keys="abc")  # type: ignore[arg-type]
