"""Faults: what a caller gets when the engine or the probe fails, and what is left behind.

- The engine-core process or the model worker process killed mid-batch (multi-process engine,
  one per test): the running call raises ``EngineDeadError`` within seconds (it used to hang
  forever), later calls raise at once, the guard fails every request of the batch closed and
  counts them, ``close()`` leaves no engine process or shared memory, and a new engine starts
  and answers in the same process: after the engine core's death, the worker test's own engine
  (the next test; it answers before its worker is killed), after the worker's, one more.
- An engine nobody closed is shut down at interpreter exit, and one whose start fails after
  vLLM started is shut down before the error propagates (a subprocess, multi-process engines).
- ``close()`` of a live engine runs vLLM's shutdown to its end: no process is force-killed, and
  nothing from ``close()`` to the end of the process warns (vLLM's log, Python's warnings and
  resource tracker); no engine process or shared memory is left (a subprocess).
- Probe faults, a full probe results store, an interrupted ``generate`` and bad per-request
  arguments, on the shared in-process engine (left as it was found).

On vLLM's CPU multi-process engine the model runs in a separate ``VLLM::Worker`` process, a
child of the ``VLLM::EngineCore`` process (a child of the test process).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client import CollectorRegistry

from guardrail.errors import ConfigError, EngineDeadError, RequestError
from guardrail.guard import GuardedLLM
from guardrail.metrics import GuardrailMetrics
from guardrail.policy import FailureMode, ProbeErrorReason
from tests.helpers import (
    FILLER,
    engine_processes,
    engine_script_env,
    live,
    run_close_script,
    run_engine_script,
    shm_mapped,
    start_engine,
)

DEATH_BOUND_S = 10.0  # the running call must raise within this long after the kill
BATCH = [("Summarize the note.", f"Note {i}: the meeting moved to room {i}.") for i in range(8)]


# -- processes and shared memory ---------------------------------------------------------------


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _assert_gone(procs: dict[int, str], shm: set[str]) -> None:
    assert live(list(procs)) == [], f"engine processes left: {procs}"
    left = {name for name in shm if (Path("/dev/shm") / name).exists()}
    assert left == set(), f"shared memory left: {left}"


def _assert_a_new_engine_starts_cleanly(model_dir: Path, before: set[int]) -> None:
    engine = start_engine(model_dir, multiprocess=True)
    procs = engine_processes(before)
    shm = shm_mapped(list(procs))
    try:
        out = engine.generate([("Summarize.", "Hi Sam, lunch at noon?")])[0]
        assert out.probe is not None and out.probe.error is None and out.probe.focus is not None
    finally:
        engine.close()
    _assert_gone(procs, shm)
    assert live(list(engine_processes(before))) == []  # nothing of either engine is left


def _kill_soon(pid: int, delay_s: float) -> list[float]:
    """SIGKILL ``pid`` after ``delay_s`` from a thread; the list gets the kill's time."""
    killed_at: list[float] = []

    def kill() -> None:
        time.sleep(delay_s)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    return killed_at


# -- engine processes killed -------------------------------------------------------------------
@pytest.mark.slow
def test_engine_core_killed_mid_batch_fails_the_batch_closed_within_seconds(tiny_llama_dir):
    before = _children()
    engine = start_engine(tiny_llama_dir, multiprocess=True)
    procs = engine_processes(before)
    shm = shm_mapped(list(procs))
    try:
        assert sorted(procs) == sorted(engine.engine_pids)
        core = next(pid for pid, name in procs.items() if "EngineCore" in name)
        registry = CollectorRegistry()
        guard = GuardedLLM.from_engine(
            engine, metrics=GuardrailMetrics(registry, model_name="tiny")
        )
        long = engine.sampling(max_tokens=1500, ignore_eos=True)  # ~10-20 s of decoding
        ids = [f"req-{i}" for i in range(len(BATCH))]
        killed_at = _kill_soon(core, 1.5)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="EngineCore") as caught:
            guard.generate(BATCH, long, request_ids=ids)
        raised = time.monotonic()
        assert killed_at and started < killed_at[0] < raised  # killed while the call ran
        assert raised - killed_at[0] < DEATH_BOUND_S
        print(f"engine core killed: call raised {raised - killed_at[0]:.3f} s after the kill")
        results = caught.value.results
        assert [r.request_id for r in results] == ids
        for result in results:
            assert result.verdict is not None and result.verdict.blocked
            assert result.verdict.failure is FailureMode.FAIL_CLOSED
            assert result.verdict.probe_error_reason is ProbeErrorReason.ENGINE
            assert result.text == "" and result.token_ids == () and not result.ok
        value = registry.get_sample_value
        assert value("guardrail_requests_total", {"model_name": "tiny", "action": "block"}) == 8
        assert value("guardrail_requests_total", {"model_name": "tiny", "action": "allow"}) == 0
        errors = {"model_name": "tiny", "reason": "engine"}
        assert value("guardrail_probe_errors_total", errors) == 8
        assert value("guardrail_probe_errors_total", {**errors, "model_name": "x"}) is None
        assert value("guardrail_requests_in_flight", {"model_name": "tiny"}) == 0
        # Later calls, of the engine and of the guard, raise at once.
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="dead"):
            engine.generate(["Hi"])
        with pytest.raises(EngineDeadError):
            engine.set_probe_faults([])
        with pytest.raises(EngineDeadError):
            guard.score(["Hi"])
        assert time.monotonic() - start < 1.0
    finally:
        engine.close()
    engine.close()  # idempotent
    _assert_gone(procs, shm)
    # the next test's engine is the new engine after this one (it answers before its own kill)


@pytest.mark.slow
def test_worker_killed_mid_batch_raises_engine_dead_within_seconds(tiny_llama_dir):
    """Run after the engine-core test (module order), its engine is also the check that a new
    engine starts and answers in a process whose engine core was killed."""
    before = _children()
    engine = start_engine(tiny_llama_dir, multiprocess=True)
    procs = engine_processes(before)
    shm = shm_mapped(list(procs))
    try:
        out = engine.generate([("Summarize.", "Hi Sam, lunch at noon?")])[0]
        assert out.probe is not None and out.probe.error is None and out.probe.focus is not None
        workers = [pid for pid, name in procs.items() if "Worker" in name]
        assert len(workers) == 1, procs  # CPU: the model runs in its own VLLM::Worker process
        long = engine.sampling(max_tokens=1500, ignore_eos=True)
        killed_at = _kill_soon(workers[0], 1.5)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="Worker") as caught:
            engine.generate(BATCH, long)
        raised = time.monotonic()
        assert killed_at and started < killed_at[0] < raised
        assert raised - killed_at[0] < DEATH_BOUND_S
        assert caught.value.results is None  # HookedLLM has no verdicts to give
        print(f"worker killed: call raised {raised - killed_at[0]:.3f} s after the kill")
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            engine.score(["Hi"])
        assert time.monotonic() - start < 1.0
    finally:
        engine.close()
    _assert_gone(procs, shm)
    _assert_a_new_engine_starts_cleanly(tiny_llama_dir, before)


_EXIT_SCRIPT = """
import json, sys
sys.path.insert(0, {root!r})
import psutil
from tests.helpers import start_engine

def liveengine_processes():
    return [p.pid for p in psutil.Process().children(recursive=True)
            if "VLLM" in p.name() and p.status() != psutil.STATUS_ZOMBIE]

if __name__ == "__main__":
    try:
        start_engine({model!r}, multiprocess=True, probe_heads=[(99, 0)])
    except Exception as exc:
        failed = type(exc).__name__
    left = liveengine_processes()
    engine = start_engine({model!r}, multiprocess=True)
    print(json.dumps({{"failed": failed, "left": left, "pids": engine.engine_pids}}), flush=True)
    # exits without close(): the engine must be shut down at interpreter exit
"""


@pytest.mark.slow
def test_engines_are_closed_when_their_start_fails_and_at_interpreter_exit(
    tiny_llama_dir, tmp_path
):
    root = str(Path(__file__).resolve().parents[2])
    script = tmp_path / "leave_engine_open.py"
    script.write_text(_EXIT_SCRIPT.format(root=root, model=str(tiny_llama_dir)))
    done = run_engine_script(script)
    line = next(x for x in done.stdout.splitlines() if x.startswith('{"failed"'))
    report = json.loads(line)
    assert report["failed"] == "HeadsDoNotFitModelError"
    assert report["left"] == []  # the failed start shut its engine down
    assert len(report["pids"]) == 2
    deadline = time.monotonic() + 10
    while live(report["pids"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live(report["pids"]) == []


_CLOSE_SCRIPT = """
import json, sys
sys.path.insert(0, {root!r})
from pathlib import Path
import psutil
from tests.helpers import start_engine

def shm_of(pids):
    names = set()
    for pid in pids:
        for line in Path(f"/proc/{{pid}}/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                names.add(fields[5].removeprefix("/dev/shm/").removesuffix(" (deleted)"))
    return sorted(names)

# What vLLM's own teardown left for the supervisor's fallback (the processes exit with their
# heap frozen, guardrail/worker/lifecycle.py: their segments must still be unlinked by them).
from guardrail.engine import engine_process
left_for_supervisor = []
unlink = engine_process.EngineSupervisor._unlink_shared_memory
def record_then_unlink(self):
    left_for_supervisor.extend(
        n for n in self.shared_memory if n.startswith("psm_") and (Path("/dev/shm") / n).exists()
    )
    unlink(self)
engine_process.EngineSupervisor._unlink_shared_memory = record_then_unlink

if __name__ == "__main__":
    engine = start_engine({model!r}, multiprocess=True)
    out = engine.generate([("Summarize.", "Hi Sam, lunch at noon?")])[0]
    pids = engine.engine_pids
    shm = shm_of(pids)
    fast_exit = engine.model_info["fast_exit"]  # the worker's; the engine core spawned it
    print("@@close", flush=True)
    print("@@close", file=sys.stderr, flush=True)
    engine.close()
    left = [p.pid for p in psutil.Process().children(recursive=True)
            if p.pid in pids and p.status() != psutil.STATUS_ZOMBIE]
    report = {{"pids": pids, "shm": shm, "left": left, "scored": out.probe.focus is not None,
              "fast_exit": fast_exit, "left_for_supervisor": left_for_supervisor}}
    print("@@report", json.dumps(report), flush=True)
"""


@pytest.mark.slow
def test_close_stops_the_engine_cleanly_leaving_nothing_and_printing_no_warning(
    tiny_llama_dir, tmp_path
):
    """From ``close()`` to the end of the process (interpreter exit included): no warning or
    error on stdout (vLLM's log) or stderr, no engine process, no shared memory."""
    root = str(Path(__file__).resolve().parents[2])
    script = tmp_path / "close_engine.py"
    script.write_text(_CLOSE_SCRIPT.format(root=root, model=str(tiny_llama_dir)))
    report, after_close, stdout = run_close_script(script)
    assert report["scored"] and len(report["pids"]) == 2 and report["shm"]
    assert report["left"] == []  # gone when close() returned
    # the engine's processes (not this one) exit with their heap frozen, and still unlink their
    # own shared memory before that: nothing was left for the supervisor's fallback
    assert report["fast_exit"] is True  # and not in this process:
    assert "GUARDRAIL_ENGINE" not in os.environ
    assert report["left_for_supervisor"] == []
    assert after_close == [], "\n".join(after_close)
    assert "[shutdown] MPClient: complete" in stdout  # vLLM's own shutdown ran to its end
    assert live(report["pids"]) == []
    left = [name for name in report["shm"] if (Path("/dev/shm") / name).exists()]
    assert left == [], f"shared memory left: {left}"


_ORPHAN_SCRIPT = """
import json, sys, time
sys.path.insert(0, {root!r})
from tests.helpers import shm_mapped, start_engine

if __name__ == "__main__":
    engine = start_engine({model!r}, multiprocess=True)
    out = engine.generate([("Summarize.", "Hi Sam, lunch at noon?")])[0]
    pids = engine.engine_pids
    print("@@engine", json.dumps({{"pids": pids, "shm": sorted(shm_mapped(pids))}}), flush=True)
    time.sleep(600)  # killed before this ends
"""


@pytest.mark.slow
def test_an_engine_whose_caller_is_killed_stops_and_frees_its_shared_memory(
    tiny_llama_dir, tmp_path
):
    """A caller killed by SIGKILL runs no cleanup at all; vLLM's engine core alone would run on,
    serving nobody. The lifecycle plugin's watch SIGTERMs it: vLLM shuts the engine down."""
    root = str(Path(__file__).resolve().parents[2])
    script = tmp_path / "orphan_engine.py"
    script.write_text(_ORPHAN_SCRIPT.format(root=root, model=str(tiny_llama_dir)))
    with (tmp_path / "stderr.txt").open("w") as stderr:
        caller = subprocess.Popen(
            [sys.executable, str(script)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=root,
            env=engine_script_env(),
        )
    assert caller.stdout is not None
    line = ""
    while not line.startswith("@@engine"):  # vLLM's log comes first
        line = caller.stdout.readline()
        assert line, (tmp_path / "stderr.txt").read_text()[-3000:]
    report = json.loads(line.removeprefix("@@engine"))
    try:
        assert len(report["pids"]) == 2 and report["shm"]
        caller.kill()
        caller.wait(10)
        deadline = time.monotonic() + 30
        while live(report["pids"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert live(report["pids"]) == [], "the engine outlived its caller"
        psm = [n for n in report["shm"] if n.startswith("psm_")]
        assert psm and [n for n in psm if (Path("/dev/shm") / n).exists()] == []
    finally:
        caller.kill()
        for pid in live(report["pids"]):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


# -- probe faults and the results store (the shared in-process engine) ---------------------------
REQUESTS = [("Summarize the note.", f"Note {i}: " + FILLER * (1 + i % 3)) for i in range(8)]


@pytest.fixture
def faults_cleared(tiny_engine: Any) -> Iterator[Any]:
    try:
        yield tiny_engine
    finally:
        tiny_engine.set_probe_faults([])


def test_a_probe_fault_fails_closed_for_that_request_alone(faults_cleared):
    engine = faults_cleared
    registry = CollectorRegistry()
    guard = GuardedLLM.from_engine(engine, metrics=GuardrailMetrics(registry, model_name="tiny"))
    ids = [f"fault-{i}" for i in range(4)]
    engine.set_probe_faults([ids[1]])
    results = guard.generate(REQUESTS[:4], engine.sampling(max_tokens=4), request_ids=ids)
    faulty = results[1].verdict
    assert faulty is not None and faulty.blocked and faulty.failure is FailureMode.FAIL_CLOSED
    assert faulty.probe_error_reason is ProbeErrorReason.LAYER  # from the worker, as data
    assert "fault injected" in (faulty.probe_error or "")
    assert results[1].text == guard.refusal_text
    for i in (0, 2, 3):
        verdict = results[i].verdict
        assert verdict is not None and verdict.probe_error is None and verdict.focus is not None
    labels = {"model_name": "tiny", "reason": "layer"}
    assert registry.get_sample_value("guardrail_probe_errors_total", labels) == 1


def test_a_request_that_could_not_be_scored_stops_by_its_own_stop_on_probe_error(
    faults_cleared,
):
    """The early stop of rows that were not scored, decided on the device from the facts the
    step's plan copied there: rows failed at the plan (a fault: not in the step's table) and rows
    flagged on the device (a KV reader one slot off) each end after prefill when their
    ``stop_on_probe_error`` says so and decode in full when not; the scored rows by their focus
    (none at or below -1). The result reports the same decision the device made."""
    from guardrail.worker.probe import PROBES

    engine = faults_cleared
    params = engine.sampling(max_tokens=6)
    keys = [f"stop-fault-{i}" for i in range(4)]
    on_error = [True, True, False, False]

    def decoded(outs: list[Any]) -> list[tuple[int, bool, bool]]:
        return [(len(o.token_ids), o.probe.stopped, o.probe.error is None) for o in outs]

    engine.set_probe_faults([keys[0], keys[2]])
    outs = engine.generate(
        REQUESTS[:4], params, stop_below=-1.0, stop_on_probe_error=on_error, probe_keys=keys
    )
    assert decoded(outs) == [
        (1, True, False),
        (6, False, True),
        (6, False, False),
        (6, False, True),
    ]
    # the step's only row failed at the plan: its stop facts are copied without a plan
    alone = engine.generate(REQUESTS[:1], params, stop_below=-1.0, probe_keys=keys[:1])
    assert decoded(alone) == [(1, True, False)]
    engine.set_probe_faults([])
    [probe] = [p for p in PROBES.values() if p.layers]
    right = probe.gather
    probe.gather = lambda cache, slots, *heads: right(cache, slots + 1, *heads)
    try:
        outs = engine.generate(REQUESTS[:4], params, stop_below=-1.0, stop_on_probe_error=on_error)
    finally:
        probe.gather = right
    assert decoded(outs) == [
        (1, True, False),
        (1, True, False),
        (6, False, False),
        (6, False, False),
    ]
    assert all("KV cache layout check failed" in (o.probe.error or "") for o in outs)


def test_a_wrong_kv_reader_is_caught_by_the_live_layout_check(tiny_engine):
    """The worker compares, on the device, each scored row's cached key of its last prompt token
    (read back through the KV reader) with the key the layer computed: a reader that reads the
    wrong slots fails every request closed, with that check named, and nothing else changes."""
    from guardrail.worker.probe import PROBES

    [probe] = [p for p in PROBES.values() if p.layers]  # the in-process engine's worker
    right = probe.gather
    probe.gather = lambda cache, slots, *heads: right(cache, slots + 1, *heads)  # one slot off
    try:
        outs = tiny_engine.generate(REQUESTS[:3], tiny_engine.sampling(max_tokens=2))
    finally:
        probe.gather = right
    for out in outs:
        assert out.probe.focus is None
        assert "KV cache layout check failed" in (out.probe.error or "")
        assert out.probe.error_reason is ProbeErrorReason.PROBE
    again = tiny_engine.generate(REQUESTS[:1], tiny_engine.sampling(max_tokens=2))[0]
    assert again.probe.error is None and again.probe.focus is not None


@pytest.mark.parametrize("store", ["pushed", "popped"])
def test_results_evicted_from_a_full_store_are_missing_never_another_score(
    tiny_engine, monkeypatch, store
):
    """Pushed: the caller's inbox keeps at most so many results; popped (the push stopped, as
    for a worker on another host): the worker's store does. Either way an evicted result is
    missing at once: the inbox remembers what it dropped, so the caller does not wait for it
    as for a result still on its way (``IN_TRANSIT_WAIT_S``)."""
    import guardrail.engine.inbox as inbox  # the caller's store of pushed results
    import guardrail.worker.results as worker_results  # the in-process engine's result store
    from guardrail.protocol import RPC_PUSH_RESULTS

    reference = [o.probe.focus for o in tiny_engine.score(REQUESTS)]
    assert all(f is not None for f in reference)
    if store == "pushed":
        monkeypatch.setattr(inbox, "MAX_STORED_RESULTS", 3)
    else:
        monkeypatch.setattr(worker_results, "MAX_STORED_RESULTS", 3)
        tiny_engine.llm.collective_rpc(RPC_PUSH_RESULTS, args=(None, ""))
    try:
        started = time.monotonic()
        _check_eviction(tiny_engine, reference)
        assert time.monotonic() - started < inbox.IN_TRANSIT_WAIT_S / 3
    finally:
        monkeypatch.undo()
        if store == "popped":
            tiny_engine.llm.collective_rpc(RPC_PUSH_RESULTS, args=tiny_engine._inbox.push_args)
    assert all(o.probe.error is None for o in tiny_engine.score(REQUESTS))


def _check_eviction(engine, reference) -> None:  # type: ignore[no-untyped-def]
    outputs = engine.score(REQUESTS)
    missing = [o.index for o in outputs if o.probe.error is not None]
    assert missing, "the store kept every result: the eviction was not exercised"
    assert len(missing) >= len(REQUESTS) - 3
    for output, focus in zip(outputs, reference, strict=True):
        if output.index in missing:
            assert output.probe.error_reason is ProbeErrorReason.MISSING
            assert output.probe.focus is None
        else:  # a kept result is its own request's score, never another's
            assert output.probe.focus == pytest.approx(focus, abs=1e-6)
    guarded = GuardedLLM.from_engine(engine).score(REQUESTS)
    for result in guarded:
        verdict = result.verdict
        assert verdict is not None
        if verdict.probe_error is not None:
            assert verdict.blocked and verdict.failure is FailureMode.FAIL_CLOSED


# -- an interrupted call, bad arguments --------------------------------------------------------
class _InterruptingBar:
    """A progress bar (vLLM's ``use_tqdm`` callable) that raises at the first finished request,
    like a Ctrl-C in the middle of a batch."""

    def __init__(self, **kwargs: Any) -> None:
        self.n = 0
        self.postfix = ""
        self.format_dict = {"elapsed": 1.0}

    def update(self, n: int) -> None:
        raise RuntimeError("interrupted mid-batch")

    def refresh(self) -> None: ...

    def close(self) -> None: ...


def _interrupting_bar(iterable: Any = None, **kwargs: Any) -> Any:
    return iterable if iterable is not None else _InterruptingBar(**kwargs)


def test_an_interrupted_generate_leaves_nothing_for_the_next_call(tiny_engine):
    params = [tiny_engine.sampling(max_tokens=n, ignore_eos=True) for n in (1, 40, 40, 40)]
    with pytest.raises(RuntimeError, match="interrupted mid-batch"):
        tiny_engine.generate(REQUESTS[:4], params, use_tqdm=_interrupting_bar)
    assert tiny_engine.llm.llm_engine.get_num_unfinished_requests() == 0
    expected = tiny_engine.generate(REQUESTS[4:6], tiny_engine.sampling(max_tokens=6))
    again = tiny_engine.generate(REQUESTS[4:6], tiny_engine.sampling(max_tokens=6))
    for a, b in zip(expected, again, strict=True):
        assert a.prompt is not None and b.prompt is not None
        assert a.prompt.token_ids == b.prompt.token_ids and a.token_ids == b.token_ids
        assert a.probe is not None and a.probe.error is None


def test_bad_per_request_arguments_fail_their_own_request(tiny_engine):
    params = tiny_engine.sampling(max_tokens=4)
    requests = REQUESTS[:4]

    def failed(outputs: list[Any]) -> list[int]:
        assert [o.index for o in outputs] == [0, 1, 2, 3]
        for o in outputs:
            if o.error is None:
                assert o.probe is not None and o.probe.error is None
            else:
                assert isinstance(o.error, RequestError) and o.probe is None
                assert str(o.error).startswith(f"request {o.index}: ")
        return [o.index for o in outputs if o.error is not None]

    outputs = tiny_engine.generate(requests, [params, None, "greedy", params])
    assert failed(outputs) == [1, 2]
    assert "must be a vllm.SamplingParams" in str(outputs[1].error)
    stops = [None, float("nan"), "0.1", 0.0]
    assert failed(tiny_engine.generate(requests, params, stop_below=stops)) == [1, 2]
    # an early stop would make eos a stop token, which ignore_eos=True asks it not to be
    eos_ignored = tiny_engine.sampling(max_tokens=4, ignore_eos=True)
    outputs = tiny_engine.generate(requests, [params, eos_ignored, params, params], stop_below=0.0)
    assert [o.error is None for o in outputs] == [True, False, True, True]
    assert "cannot be combined with ignore_eos=True" in str(outputs[1].error)
    keys = ["k-0", 5, "k-0", None]
    assert failed(tiny_engine.generate(requests, params, probe_keys=keys)) == [1, 2]
    flags = [True, "yes", False, True]
    assert failed(tiny_engine.generate(requests, params, stop_on_probe_error=flags)) == [1]
    steering = [None, "no-such-vector", None, None]
    assert failed(tiny_engine.generate(requests, params, steering=steering)) == [1]
    # One bad value for every request is a bad call.
    with pytest.raises(ConfigError, match=r"sampling params must be a vllm\.SamplingParams"):
        tiny_engine.generate(requests, "greedy")
    with pytest.raises(ConfigError, match="stop_below must be None or a finite number"):
        tiny_engine.generate(requests, params, stop_below="0.1")
    with pytest.raises(ConfigError, match="probe_keys must be a list"):
        tiny_engine.generate(requests, params, probe_keys="k")
    # The guard: the request with None alone fails, naming its index; the other is answered.
    guard = GuardedLLM.from_engine(tiny_engine)
    ok, bad = guard.generate(requests[:2], [params, None])
    assert ok.verdict is not None and ok.error is None
    assert isinstance(bad.error, RequestError) and bad.verdict is None
    assert str(bad.error).startswith("request 1: its sampling params are None")
