"""``HookedBase``: what the sync and async engines share, written once. The installation plan
is checked on a model-free stand-in (the engines send exactly ``rpc_args``), and both engines
are held to take the shared members from the base rather than write their own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from guardrail.engine.async_hooked import AsyncHookedLLM
from guardrail.engine.hooked import HookedLLM
from guardrail.engine.hooked_base import HookedBase, refused_as_not_guardable
from guardrail.errors import EngineNotGuardableError
from guardrail.probe.config import ModelProbeConfig
from guardrail.testing import FakeEngine

CONFIG = ModelProbeConfig(model_id="m", heads=[(0, 1), (1, 0)], threshold=0.5)


class _Engine(HookedBase):
    """A started engine as far as the base sees one: its model, config and tokenizer."""

    def __init__(self, config: ModelProbeConfig) -> None:
        self.model = "m"
        self.config = config
        self._tokenizer = SimpleNamespace(eos_token_id=2)


def _info() -> dict:
    return dict(FakeEngine(CONFIG, None, lambda prompt, attempt: 0.5).model_info)


def test_the_install_plan_is_what_the_engine_keeps_and_sends() -> None:
    engine, info = _Engine(CONFIG), _info()
    install = engine._plan_install(info, None, [3, 1, 1], ["2"])  # type: ignore[arg-type]
    assert install.heads == engine.probe_heads == [(0, 1), (1, 0)]
    assert engine.probe_hidden_layers == install.hidden_layers == [1, 3]
    assert engine.probe_data_mean_layers == install.data_mean_layers == [2]
    assert install.rpc_args == ([[0, 1], [1, 0]], CONFIG.model_dump(mode="json"), [3, 1, 1], [2])
    assert install.reset_prefix_cache  # a data-mean memo starts empty
    assert engine.probe is install.client and engine.stop_token == 2
    assert engine.model_info is info


def test_the_prefix_cache_is_kept_without_a_data_mean_read_out() -> None:
    engine = _Engine(CONFIG)
    install = engine._plan_install(_info(), "all", [], [])  # type: ignore[arg-type]
    assert not install.reset_prefix_cache
    assert len(install.heads) == 4 * 4  # every head of the pretend model


def test_a_head_the_model_lacks_is_refused_before_anything_is_sent() -> None:
    with pytest.raises(Exception, match="head"):
        _Engine(CONFIG)._plan_install(_info(), [(0, 99)], [], [])  # type: ignore[arg-type]


def test_a_probe_the_workers_refuse_makes_the_engine_not_guardable() -> None:
    with pytest.raises(EngineNotGuardableError, match="quantized"), refused_as_not_guardable():
        raise ValueError("quantized KV cache (fp8) is not supported by the probe")


def test_a_refusal_through_vllms_engine_core_makes_the_engine_not_guardable() -> None:
    """A multi-process engine: vLLM's engine core hands the worker's error over as a plain
    ``Exception`` with only its message (``Call to collective_rpc method failed: ...``)."""
    from guardrail.protocol import NOT_GUARDABLE

    refusal = ValueError(f"{NOT_GUARDABLE}the hidden-state signal needs enforce_eager=True")
    with pytest.raises(EngineNotGuardableError) as caught, refused_as_not_guardable():
        raise Exception(f"Call to collective_rpc method failed: {refusal}")
    assert str(caught.value) == "the hidden-state signal needs enforce_eager=True"
    oom = Exception("Call to collective_rpc method failed: CUDA out of memory")
    with pytest.raises(Exception, match="CUDA out of memory") as other, refused_as_not_guardable():
        raise oom
    assert not isinstance(other.value, EngineNotGuardableError)


def test_both_engines_take_what_they_share_from_hooked_base() -> None:
    shared = {name for name in vars(HookedBase) if not name.startswith("__")}
    assert {"sampling", "stop_token", "tokenizer", "_plan_install"} <= shared
    for engine in (HookedLLM, AsyncHookedLLM):
        assert issubclass(engine, HookedBase)
        assert not shared & set(vars(engine)), engine.__name__
