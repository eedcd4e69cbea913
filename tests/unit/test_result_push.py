"""Pushed probe results: the worker's ``ResultPusher`` and the caller's ``ResultInbox`` over a
real ZeroMQ socket, with the worker's real ``ResultStore`` (CPU tables, no engine)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from guardrail.engine.inbox import ResultInbox
from guardrail.worker.outbox import ResultPusher
from guardrail.worker.results import FinishedStep, ResultStore
from guardrail.worker.rows import FLAG_MESSAGES, StepRows

HEADS = [[0, 1], [2, 3]]
WIDTH = 5  # stats per head


def finished_step(keys: list[str], tags: list[str | None]) -> FinishedStep:
    """A step whose every row was scored: row r's stats are r, r+0.1, ... (two heads)."""
    n = len(keys)
    rows = StepRows(
        keys=list(keys),
        tags=list(tags),
        num_prompt_tokens=[10 + r for r in range(n)],
        errors=[None] * n,
        reasons=[None] * n,
        stop_below=[None] * n,
        stop_on_error=[True] * n,
        stop_token=[None] * n,
        has_data=[True] * n,
        ok=list(range(n)),
    )
    stats = np.array([[r + 0.1 * c for c in range(2 * WIDTH)] for r in range(n)])
    flags = np.zeros((n, len(FLAG_MESSAGES)))
    table = torch.from_numpy(np.concatenate([stats, flags], axis=1))
    columns = {
        "stats": slice(0, 2 * WIDTH),
        "flags": slice(2 * WIDTH, 2 * WIDTH + len(FLAG_MESSAGES)),
        "terms": slice(0, 0),
    }
    return FinishedStep(rows, table, None, None, columns, 0.002)


@pytest.fixture
def inbox():
    box = ResultInbox()
    yield box
    box.close()


def test_pushed_results_arrive_with_hello_heads_and_values(inbox):
    store = ResultStore()
    pusher = ResultPusher(inbox.address, store, inbox.hello, HEADS)
    try:
        assert inbox.accepted([True]) and inbox.heads == HEADS
        store.add(finished_step(["a", "b"], ["t1", "t1"]))
        got = inbox.take(["a", "b"], "t1", 5.0)
        assert sorted(got) == ["a", "b"]
        stats = np.frombuffer(got["b"]["stats"], dtype=np.float64)
        assert stats.tolist() == pytest.approx([1 + 0.1 * c for c in range(2 * WIDTH)])
        assert got["b"]["num_prompt_tokens"] == 11 and got["b"]["tag"] == "t1"
        pusher.flush()
        assert pusher.sent == 2
        assert store.pop(["a", "b"]) == {}  # sent, so no longer in the worker
    finally:
        pusher.close()


def test_untagged_results_stay_for_a_pop_and_other_tags_are_not_taken(inbox):
    store = ResultStore()
    pusher = ResultPusher(inbox.address, store, inbox.hello, HEADS)
    try:
        store.add(finished_step(["raw", "old", "new"], [None, "earlier-call", "this-call"]))
        assert sorted(inbox.take(["new"], "this-call", 5.0)) == ["new"]
        # the same key from an earlier call is never taken by this one
        assert inbox.take(["old"], "this-call", 0.2) == {}
        popped = store.pop(["raw", "old"])
        assert sorted(popped) == ["raw"] and "tag" not in popped["raw"]
    finally:
        pusher.close()


def test_a_pop_waits_for_the_pusher_then_the_store_pops_again(inbox):
    store = ResultStore()
    pusher = ResultPusher(inbox.address, store, inbox.hello, HEADS)
    store.add(finished_step(["k"], ["t"]))
    assert store.pop(["k"]) == {}  # flushed: sent, not stored
    assert "k" in inbox.take(["k"], "t", 5.0)
    pusher.close()
    assert store.push is None
    store.add(finished_step(["k2"], ["t"]))
    assert sorted(store.pop(["k2"])) == ["k2"]  # no pusher: stored and popped as before


def test_async_future_and_a_given_up_future(inbox):
    store = ResultStore()
    pusher = ResultPusher(inbox.address, store, inbox.hello, HEADS)

    async def main() -> tuple[int, dict]:
        waiting = inbox.future("a", "t")
        store.add(finished_step(["a"], ["t"]))
        first = await asyncio.wait_for(waiting, 5.0)
        # a future given up by a timeout: the result arriving later is kept for take
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(inbox.future("b", "t"), 0.05)
        store.add(finished_step(["b"], ["t"]))
        late = await asyncio.to_thread(inbox.take, ["b"], "t", 5.0)
        return first["num_prompt_tokens"], late

    try:
        tokens, late = asyncio.run(main())
        assert tokens == 10 and sorted(late) == ["b"]
    finally:
        pusher.close()


def test_a_silent_worker_is_not_accepted(inbox, monkeypatch):
    monkeypatch.setattr("guardrail.engine.inbox.HELLO_TIMEOUT_S", 0.2)
    assert not inbox.accepted([True])  # nobody said hello
    assert not inbox.accepted([False])  # no rank pushes (pipeline parallelism)


def test_the_pusher_names_the_keys_it_took_once_and_a_pop_says_which_are_on_their_way(inbox):
    from guardrail.engine.inbox import in_transit

    store = ResultStore()
    pusher = ResultPusher(inbox.address, store, inbox.hello, HEADS)
    try:
        store.add(finished_step(["a", "raw"], ["t", None]))
        popped = store.pop(["a", "raw", "never"])  # waits for the pusher: "a" was sent
        assert sorted(popped) == ["raw"]  # untagged: kept for the pop
        taken = pusher.in_transit([k for k in ["a", "raw", "never"] if k not in popped])
        assert taken == ["a"]  # the tagged one; "never" was never made
        assert pusher.in_transit(["a"]) == []  # named once
        ranks = [
            {"heads": HEADS, "results": popped, "pushed": taken},
            {"heads": HEADS, "results": {}, "pushed": ["raw"]},  # popped from another rank
        ]
        assert in_transit(ranks) == ["a"]
        assert "a" in inbox.take(["a"], "t", 5.0)
    finally:
        pusher.close()


def test_a_wait_for_results_on_their_way_ends_when_the_engine_dies(inbox):
    """A result a pop said was sent is waited for up to a minute, but not past the engine's
    death (it sends nothing more): the wait ends within a poll of it."""
    dead = threading.Event()
    threading.Timer(0.3, dead.set).start()
    started = time.monotonic()
    assert inbox.take(["on-its-way"], "t", 60.0, stop=dead.is_set) == {}
    assert time.monotonic() - started < 2.0


def test_a_result_dropped_untaken_is_missing_at_once_not_waited_for(inbox, monkeypatch, caplog):
    """More untaken results than the inbox keeps: the oldest go, and asking for one of those
    returns at once without it (the pop says it was sent, so it used to be waited for up to
    ``IN_TRANSIT_WAIT_S``), while the kept ones are still there, each its own."""
    monkeypatch.setattr("guardrail.engine.inbox.MAX_STORED_RESULTS", 2)
    store = ResultStore()
    pusher = ResultPusher(inbox.address, store, inbox.hello, HEADS)
    try:
        store.add(finished_step(["a", "b", "c", "d"], ["t"] * 4))
        pusher.flush()
        deadline = time.monotonic() + 5.0
        while inbox.received < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert inbox.received == 4
        started = time.monotonic()
        got = inbox.take(["a", "b", "c", "d"], "t", 60.0)
        assert time.monotonic() - started < 1.0
        assert sorted(got) == ["c", "d"]
        assert np.frombuffer(got["d"]["stats"], dtype=np.float64)[0] == pytest.approx(3.0)
        assert "never taken" in caplog.text
        # asked again, as a caller does after a pop says "a" was sent: at once again
        started = time.monotonic()
        assert inbox.take(["a", "b"], "t", 60.0) == {}
        assert time.monotonic() - started < 1.0
    finally:
        pusher.close()
