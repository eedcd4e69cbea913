"""The sync and async engines are built with the same arguments: their signatures cannot drift.

``AsyncHookedLLM.create`` once took no hidden-layer or data-mean arguments while its docstring
said "same arguments as HookedLLM"; this test fails the day the two differ again.
"""

from __future__ import annotations

import inspect

from guardrail.engine.async_hooked import AsyncHookedLLM
from guardrail.engine.hooked import HookedLLM


def _parameters(function: object) -> list[tuple[str, object, object, object]]:
    """Name, kind, default and annotation of each parameter after ``self`` / ``cls``."""
    parameters = list(inspect.signature(function).parameters.values())
    return [(p.name, p.kind, p.default, p.annotation) for p in parameters]


def test_async_create_takes_exactly_the_sync_constructors_arguments():
    sync = _parameters(HookedLLM.__init__)[1:]  # without self
    async_ = _parameters(AsyncHookedLLM.create)  # a classmethod: cls is bound already
    assert async_ == sync


def test_the_comparison_sees_a_difference():
    def other(model=None, probe_config=None, *, probe_heads=None, **engine_kwargs):
        pass

    assert _parameters(other) != _parameters(HookedLLM.__init__)[1:]
