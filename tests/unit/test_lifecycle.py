"""The vLLM plugin for a guarded engine's processes (guardrail/worker/lifecycle.py): they exit
without collecting their heap and stop when their parent is gone; and how the caller hands it to
the processes vLLM spawns.

Both effects are observable without vLLM: garbage left at exit is finalised by Python's last
collection unless the heap was frozen, and a process whose parent was killed either stops or
runs on. Each case runs in a spawned process under the name vLLM would give it."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import time
from importlib.metadata import entry_points
from pathlib import Path

import psutil
import pytest

from guardrail.engine.engine_process import EngineHandle
from guardrail.protocol import ENGINE_ENV, FAST_EXIT_ENV


class _Cycle:
    """Garbage in a reference cycle whose finaliser leaves a file behind when it runs."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.me = self

    def __del__(self) -> None:
        Path(self.path).write_text("finalised")


def _leave_garbage_at_exit(path: str) -> None:
    from guardrail.worker import lifecycle  # as vLLM's plugin loader imports it, in the child

    gc.set_threshold(1_000_000)  # no automatic collection before exit: only the final one
    lifecycle.register()
    lifecycle.register()  # vLLM may load plugins more than once per process
    _Cycle(path)


def _spawn(target, args, name: str, env: dict[str, str]) -> multiprocessing.Process:  # type: ignore[no-untyped-def]
    """Start ``target`` in a spawned process called ``name``, with ``env`` on top of (and only
    for) this process's environment."""
    saved = {k: os.environ.get(k) for k in (ENGINE_ENV, FAST_EXIT_ENV)}
    try:
        for k in saved:
            os.environ.pop(k, None)
        os.environ.update(env)
        process = multiprocessing.get_context("spawn").Process(target=target, args=args, name=name)
        process.start()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
    return process


def _finalised_at_exit(tmp_path: Path, name: str, env: dict[str, str]) -> bool:
    path = tmp_path / "finalised"
    process = _spawn(_leave_garbage_at_exit, (str(path),), name, env)
    process.join(60)
    assert process.exitcode == 0  # the exit code is Python's own
    return path.exists()


@pytest.mark.parametrize("name", ["EngineCore", "EngineCore_DP1", "VllmWorker-0"])
def test_an_engine_process_of_a_guarded_engine_skips_the_collection_at_exit(tmp_path, name):
    assert not _finalised_at_exit(tmp_path, name, {ENGINE_ENV: "1"})


@pytest.mark.parametrize(
    ("name", "env"),
    [
        ("VllmWorker-0", {}),  # an engine this library did not start
        ("VllmWorker-0", {ENGINE_ENV: "1", FAST_EXIT_ENV: "0"}),  # turned off by the user
        ("SpawnProcess-1", {ENGINE_ENV: "1"}),  # not a vLLM engine process (the caller's pool)
    ],
)
def test_any_other_process_collects_its_heap_at_exit(tmp_path, name, env):
    assert _finalised_at_exit(tmp_path, name, env)


# -- an engine core whose caller was killed ---------------------------------------------------


def _engine_core(marker: str) -> None:
    from guardrail.worker import lifecycle

    def stopped(signum, frame):  # type: ignore[no-untyped-def]
        Path(marker).write_text("SIGTERM")  # as vLLM's handler would, it shuts down
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stopped)
    lifecycle.register()
    Path(marker + ".pid").write_text(str(os.getpid()))
    time.sleep(120)


def _caller(marker: str, name: str, env: dict[str, str]) -> None:
    _spawn(_engine_core, (marker,), name, env)
    time.sleep(120)


def _outlives_killed_caller(tmp_path: Path, name: str, env: dict[str, str]) -> bool:
    """Start a caller that starts an engine-core-like process, SIGKILL the caller, and say
    whether that process is still running 10 s later (else it must have had SIGTERM)."""
    marker = str(tmp_path / "core")
    caller = multiprocessing.get_context("spawn").Process(target=_caller, args=(marker, name, env))
    caller.start()
    pid_file = Path(marker + ".pid")
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    core = psutil.Process(int(pid_file.read_text()))
    caller.kill()
    caller.join(10)
    try:
        core.wait(10)
    except psutil.TimeoutExpired:
        core.kill()
        return True
    assert Path(marker).read_text() == "SIGTERM"
    return False


def test_an_engine_core_stops_when_its_caller_is_killed(tmp_path):
    assert not _outlives_killed_caller(tmp_path, "EngineCore", {ENGINE_ENV: "1"})


def test_the_watch_is_only_in_engine_cores_of_guarded_engines(tmp_path):
    # the control: without the plugin armed, an orphaned engine core runs on (vLLM's behaviour)
    assert _outlives_killed_caller(tmp_path, "EngineCore", {})


def test_vllm_finds_the_plugin_through_its_entry_point_group():
    plugins = entry_points(group="vllm.general_plugins")
    (plugin,) = [e for e in plugins if e.name.startswith("guardrail")]
    from guardrail.worker import lifecycle

    assert plugin.load() is lifecycle.register


def test_the_variable_is_set_only_while_an_engine_is_spawned(monkeypatch):
    monkeypatch.delenv(ENGINE_ENV, raising=False)
    with EngineHandle.spawning():
        assert os.environ[ENGINE_ENV] == "1"
    assert ENGINE_ENV not in os.environ
    monkeypatch.setenv(ENGINE_ENV, "x")
    with EngineHandle.spawning():
        assert os.environ[ENGINE_ENV] == "1"
    assert os.environ[ENGINE_ENV] == "x"
