"""``guardrail.engine.vllm_client`` was renamed ``guardrail.engine.engine_process`` (it supervises
the engine's processes; it is no client). The old import path must keep giving the very same
objects, so that code importing it, or patching a class through it, sees no difference."""

from __future__ import annotations

import importlib

from guardrail.engine import engine_process


def test_the_old_path_gives_the_same_objects_as_the_new_one() -> None:
    old = importlib.import_module("guardrail.engine.vllm_client")
    assert set(engine_process.__all__) <= set(old.__all__)
    for name in old.__all__:
        assert getattr(old, name) is getattr(engine_process, name), name
