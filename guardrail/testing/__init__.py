"""Test seams shipped for users' tests too: ``FakeEngine`` (a model-free ``GuardEngine``) and
tiny random-initialised chat models built locally (``tiny_models``)."""

from guardrail.testing.fake_engine import FakeEngine, FocusFn

__all__ = ["FakeEngine", "FocusFn"]
