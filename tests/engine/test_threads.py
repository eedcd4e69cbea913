"""Many threads, one engine: calls are serialised, and every caller gets its own results.

Eight threads make several calls each on one engine: ``generate`` with their own probe keys,
``score``, a ``GuardedLLM`` on the same engine, steering vectors loaded and unloaded, residual
capture and probe faults. Each thread's outputs are matched to its own requests: the prompt's
token ids, the generated token ids and the probe's focus equal those of the same batch run
alone beforehand, and a probe fault aimed at one thread's key fails that request only. Run on
the shared in-process engine, and on a multi-process engine, which is then closed from another
thread while calls run (they end with ``EngineClosedError``; no engine process is left).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest

from guardrail.errors import EngineClosedError
from guardrail.guard import GuardedLLM
from tests.helpers import FILLER, random_vector, start_engine

THREADS = 8
CALLS = 3


def _requests(thread: int, call: int) -> list[Any]:
    data = [f"Call {call}. " + FILLER * (1 + r + thread % 2) for r in range(3)]
    return [(f"Summarize note {r} for reader {thread}.", d) for r, d in enumerate(data)]


def _keys(thread: int, call: int) -> list[str]:
    return [f"t{thread}-c{call}-r{r}" for r in range(3)]


def _reference(engine: Any, params: Any) -> dict[tuple[int, int], list[Any]]:
    """Every thread's batches, run one at a time before any thread starts."""
    return {
        (t, c): engine.generate(_requests(t, c), params, probe_keys=_keys(t, c))
        for t in range(THREADS)
        for c in range(CALLS)
    }


def _same(got: list[Any], expected: list[Any]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.error is None and a.prompt is not None and b.prompt is not None
        assert a.prompt.token_ids == b.prompt.token_ids  # this thread's own request
        assert a.token_ids == b.token_ids
        assert a.probe is not None and b.probe is not None and a.probe.error is None
        assert a.probe.focus == pytest.approx(b.probe.focus, abs=1e-5)


def _run_threads(work: Callable[[int], None]) -> list[BaseException]:
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            work(index)
        except BaseException as exc:  # reported by the test, never lost in a thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread is still waiting on the engine"
    return errors


def _hammer(engine: Any, extras: bool) -> None:
    """8 threads x CALLS calls on one engine; every result checked against the reference."""
    params = engine.sampling(max_tokens=8)
    reference = _reference(engine, params)
    guard = GuardedLLM.from_engine(engine)
    faulted = "t0-c1-r2"

    def work(t: int) -> None:
        for c in range(CALLS):
            requests, keys = _requests(t, c), _keys(t, c)
            if t == 0 and c == 1:  # a probe fault aimed at one request of this thread
                engine.set_probe_faults([faulted])
                outputs = engine.generate(requests, params, probe_keys=keys)
                engine.set_probe_faults([])
                assert outputs[2].probe is not None and outputs[2].probe.error is not None
                _same(outputs[:2], reference[(t, c)][:2])
            elif t == 1:  # a guard on the same engine: verdicts carry this thread's ids
                ids = [f"guard-{k}" for k in keys]
                results = guard.generate(requests, params, request_ids=ids)
                assert [r.request_id for r in results] == ids
                for result, expected in zip(results, reference[(t, c)], strict=True):
                    assert result.verdict is not None and result.verdict.request_id
                    assert result.verdict.request_id == result.request_id
                    assert result.verdict.focus == pytest.approx(expected.probe.focus, abs=1e-5)
            elif t == 2:  # probe only
                scored = engine.score(requests)
                for got, expected in zip(scored, reference[(t, c)], strict=True):
                    assert got.prompt.token_ids == expected.prompt.token_ids
                    assert got.probe.focus == pytest.approx(expected.probe.focus, abs=1e-5)
            elif t == 3 and extras:  # steering RPCs between other threads' calls
                vector = random_vector(engine, name=f"thread-vec-{c}")
                with engine.steering_vector(vector):
                    steered = engine.generate(requests, params, steering=vector.name)
                assert all(o.steering is not None and o.steering.error is None for o in steered)
                _same(engine.generate(requests, params, probe_keys=keys), reference[(t, c)])
            elif t == 4 and extras:  # residual capture
                captured = engine.capture_residuals(requests, [1])
                assert len(captured) == 3 and all(set(r) == {1} for r in captured)
                _same(engine.generate(requests, params, probe_keys=keys), reference[(t, c)])
            else:
                _same(engine.generate(requests, params, probe_keys=keys), reference[(t, c)])

    errors = _run_threads(work)
    assert errors == [], errors[:3]
    assert engine.steering_vectors == {}


def test_eight_threads_share_the_in_process_engine(tiny_engine):
    try:
        _hammer(tiny_engine, extras=True)
    finally:
        tiny_engine.set_probe_faults([])


@pytest.mark.slow
def test_eight_threads_share_a_multiprocess_engine_and_close_waits_for_them(tiny_llama_dir):
    engine = start_engine(tiny_llama_dir, multiprocess=True)
    pids = list(engine.engine_pids)
    try:
        assert len(pids) == 2
        _hammer(engine, extras=False)
        # close() from the main thread while the threads keep calling: the running call ends,
        # then every thread gets EngineClosedError (no crash, no hang).
        params = engine.sampling(max_tokens=16)
        answered = [0] * THREADS
        ended: list[BaseException | None] = [None] * THREADS

        def work(t: int) -> None:
            while True:
                try:
                    engine.generate(_requests(t, 0), params)
                except EngineClosedError as exc:
                    ended[t] = exc
                    return
                answered[t] += 1

        closer = threading.Timer(3.0, engine.close)
        closer.start()
        errors = _run_threads(work)
        closer.join()
        assert errors == []
        assert all(isinstance(e, EngineClosedError) for e in ended)
        assert sum(answered) > 0
    finally:
        engine.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(_running(pid) for pid in pids)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
