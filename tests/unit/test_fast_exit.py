"""The vLLM plugin that lets a guarded engine's processes exit without collecting their heap
(guardrail/worker/fast_exit.py), and how the caller hands it to the processes vLLM spawns.

The plugin's effect is observable without vLLM: garbage left at exit is finalised by Python's
last collection unless the heap was frozen. Each case runs in a spawned process under the name
vLLM would give it."""

from __future__ import annotations

import gc
import multiprocessing
import os
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from guardrail.engine.vllm_client import EngineHandle
from guardrail.protocol import FAST_EXIT_ENV


class _Cycle:
    """Garbage in a reference cycle whose finaliser leaves a file behind when it runs."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.me = self

    def __del__(self) -> None:
        Path(self.path).write_text("finalised")


def _leave_garbage_at_exit(path: str) -> None:
    from guardrail.worker import fast_exit  # as vLLM's plugin loader imports it, in the child

    gc.set_threshold(1_000_000)  # no automatic collection before exit: only the final one
    fast_exit.register()
    fast_exit.register()  # vLLM may load plugins more than once per process
    _Cycle(path)


def _finalised_at_exit(tmp_path: Path, name: str, env: str | None) -> bool:
    path = tmp_path / f"{name}-{env}"
    saved = os.environ.pop(FAST_EXIT_ENV, None)
    try:
        if env is not None:
            os.environ[FAST_EXIT_ENV] = env
        process = multiprocessing.get_context("spawn").Process(
            target=_leave_garbage_at_exit, args=(str(path),), name=name
        )
        process.start()
        process.join(60)
    finally:
        os.environ.pop(FAST_EXIT_ENV, None)
        if saved is not None:
            os.environ[FAST_EXIT_ENV] = saved
    assert process.exitcode == 0  # the exit code is Python's own
    return path.exists()


@pytest.mark.parametrize("name", ["EngineCore", "EngineCore_DP1", "VllmWorker-0"])
def test_an_engine_process_of_a_guarded_engine_skips_the_collection_at_exit(tmp_path, name):
    assert not _finalised_at_exit(tmp_path, name, "1")


@pytest.mark.parametrize(
    ("name", "env"),
    [
        ("VllmWorker-0", None),  # an engine this library did not start
        ("VllmWorker-0", "0"),  # turned off by the user
        ("SpawnProcess-1", "1"),  # not a vLLM engine process (e.g. the caller's own pool)
    ],
)
def test_any_other_process_collects_its_heap_at_exit(tmp_path, name, env):
    assert _finalised_at_exit(tmp_path, name, env)


def test_vllm_finds_the_plugin_through_its_entry_point_group():
    plugins = entry_points(group="vllm.general_plugins")
    (plugin,) = [e for e in plugins if e.name.startswith("guardrail")]
    from guardrail.worker import fast_exit

    assert plugin.load() is fast_exit.register


def test_the_variable_is_set_only_while_an_engine_is_spawned_and_a_users_value_wins(monkeypatch):
    monkeypatch.delenv(FAST_EXIT_ENV, raising=False)
    with EngineHandle.spawning():
        assert os.environ[FAST_EXIT_ENV] == "1"
    assert FAST_EXIT_ENV not in os.environ
    monkeypatch.setenv(FAST_EXIT_ENV, "0")
    with EngineHandle.spawning():
        assert os.environ[FAST_EXIT_ENV] == "0"
    assert os.environ[FAST_EXIT_ENV] == "0"
