"""The sync and async guards take the same arguments, and the settings they take are
``GuardSettings``'s: the twins' signatures cannot drift apart, nor from the one definition.

``GuardedLLM(model, ...)`` pairs with ``AsyncGuardedLLM.create(model, ...)`` (both start an
engine), ``GuardedLLM.from_engine(engine, ...)`` with ``AsyncGuardedLLM(engine, ...)`` (both
guard one), and the two ``generate`` methods take the same per-call arguments.
"""

from __future__ import annotations

import dataclasses
import inspect

from guardrail.guard.async_guarded import AsyncGuardedLLM
from guardrail.guard.core import GuardCore
from guardrail.guard.guarded import GuardedLLM
from guardrail.guard.settings import GuardSettings

Parameter = tuple[str, object, object, object]


def _parameters(function: object) -> list[Parameter]:
    """Name, kind, default and annotation of each parameter (``self`` included, if unbound)."""
    parameters = inspect.signature(function).parameters.values()
    return [(p.name, p.kind, p.default, p.annotation) for p in parameters]


def _settings(function: object) -> list[tuple[str, object, object]]:
    """The parameters named like a ``GuardSettings`` field: name, default, annotation."""
    names = {f.name for f in dataclasses.fields(GuardSettings)}
    return [(n, default, ann) for n, _, default, ann in _parameters(function) if n in names]


SETTINGS = [(f.name, f.default, f.type) for f in dataclasses.fields(GuardSettings)]
CONSTRUCTORS = [
    GuardedLLM.__init__,
    GuardedLLM.from_engine,
    AsyncGuardedLLM.__init__,
    AsyncGuardedLLM.create,
]


def test_every_constructor_takes_the_settings_as_guard_settings_defines_them():
    for constructor in CONSTRUCTORS:
        assert _settings(constructor) == SETTINGS, constructor.__qualname__
        names = {name for name, *_ in SETTINGS}
        kinds = {kind for name, kind, *_ in _parameters(constructor) if name in names}
        assert kinds == {inspect.Parameter.KEYWORD_ONLY}, constructor.__qualname__


def test_starting_an_engine_takes_the_same_arguments_sync_and_async():
    sync = _parameters(GuardedLLM.__init__)[1:]  # without self
    async_ = _parameters(AsyncGuardedLLM.create)  # a classmethod: cls is bound already
    # only the sync ``model`` also takes a running engine (``GuardedLLM(engine)``)
    assert [p[:3] for p in async_] == [p[:3] for p in sync]
    assert async_[1:] == sync[1:]


def test_guarding_an_engine_takes_the_same_arguments_sync_and_async():
    sync = _parameters(GuardedLLM.from_engine)
    async_ = _parameters(AsyncGuardedLLM.__init__)[1:]  # without self
    assert async_[-1][:3] == ("owns_engine", inspect.Parameter.KEYWORD_ONLY, False)
    # the engines' types differ (a GuardEngine, an AsyncHookedLLM); nothing else does
    assert [p[:3] for p in async_[:-1]] == [p[:3] for p in sync]
    assert async_[1:-1] == sync[1:]


def test_generate_takes_the_same_arguments_sync_and_async():
    assert _parameters(AsyncGuardedLLM.generate) == _parameters(GuardedLLM.generate)


def test_what_the_guards_share_is_written_once_in_guard_core():
    shared = {name for name in vars(GuardCore) if not name.startswith("_")}
    assert {"policies", "model_name", "on_block", "close"} <= shared
    for guard in (GuardedLLM, AsyncGuardedLLM):
        assert issubclass(guard, GuardCore)
        assert not shared & set(vars(guard)), guard.__name__


def test_the_comparison_sees_a_difference():
    def other(self, engine, policies=None, *, on_block="raise", refusal_text="", metrics=None):
        pass

    assert _settings(other) != SETTINGS
    assert _parameters(other) != _parameters(AsyncGuardedLLM.__init__)
