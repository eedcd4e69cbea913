"""One engine, many callers: a micro-batcher in front of a ``GuardedLLM``.

``vllm.LLM.generate`` is synchronous and must not be entered from several threads at once, yet a
LangChain app calls its model from thread pools (``batch``) and event loops (``ainvoke``). Every
call for an engine goes through that engine's ``EngineBatcher``: a single worker thread takes the
first waiting request, collects whatever else arrives within ``window_s`` (up to ``max_batch``),
and sends it as one ``generate`` (or ``score``) batch. Callers wait on a
``concurrent.futures.Future``; async callers await it with ``asyncio.wrap_future``, so no event
loop thread is ever blocked. The worker starts on the first request and exits when idle.

Example:
    >>> future = batcher_for(guarded).submit(guarded, "Hi", params)  # doctest: +SKIP
    >>> future.result().verdict.action  # doctest: +SKIP
    <Action.ALLOW: 'allow'>
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

from guardrail.guard.guarded import GuardedLLM, GuardedResult
from guardrail.policy.kinds import Policy
from guardrail.probe.prompts import RequestLike

BATCH_WINDOW_S = 0.005
MAX_BATCH = 64
IDLE_EXIT_S = 1.0


@dataclass(eq=False)
class EngineJob:
    """One request waiting for the engine, and the future its caller waits on."""

    guarded: GuardedLLM
    request: RequestLike
    sampling: Any  # vllm.SamplingParams; unused when scoring
    policies: tuple[Policy, ...] | None
    scoring: bool
    future: Future[GuardedResult] = field(default_factory=Future)


def _non_raising(guarded: GuardedLLM) -> GuardedLLM:
    """The same guard with ``on_block="refuse"``: one blocked request must not fail a batch
    that other callers share (the adapter turns a blocked result into its own exception)."""
    if guarded.on_block == "refuse":
        return guarded
    return GuardedLLM.from_engine(
        guarded.engine,
        guarded.policies,
        on_block="refuse",
        refusal_text=guarded.refusal_text,
        metrics=guarded.metrics,
        early_block=guarded.early_block,
        model_name=guarded.model_name,
    )


def run_jobs(jobs: list[EngineJob]) -> None:
    """Run jobs of one guard and one kind (generate or score) as a single engine batch.

    Every job's future gets its result, or the batch's exception; cancelled jobs are skipped.
    """
    jobs = [j for j in jobs if j.future.set_running_or_notify_cancel()]
    if not jobs:
        return
    guarded = _non_raising(jobs[0].guarded)
    requests = [j.request for j in jobs]
    policies = None if all(j.policies is None for j in jobs) else [j.policies for j in jobs]
    try:
        if jobs[0].scoring:
            results = guarded.score(requests, policies=policies)
        else:
            results = guarded.generate(requests, [j.sampling for j in jobs], policies=policies)
    except BaseException as exc:  # the engine failed for everyone: each caller re-raises it
        for job in jobs:
            job.future.set_exception(exc)
        return
    for job, result in zip(jobs, results, strict=True):
        job.future.set_result(result)


class EngineBatcher:
    """Serialises and batches every call to one engine (see the module docstring).

    Example:
        >>> batcher = EngineBatcher(window_s=0.005)
        >>> batcher.submit(guarded, "Hi", params).result().text  # doctest: +SKIP
        'Hello!'
    """

    def __init__(
        self,
        window_s: float = BATCH_WINDOW_S,
        max_batch: int = MAX_BATCH,
        idle_exit_s: float = IDLE_EXIT_S,
    ) -> None:
        self.window_s = window_s
        self.max_batch = max_batch
        self.idle_exit_s = idle_exit_s
        self._queue: queue.Queue[EngineJob] = queue.Queue()
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None

    def submit(
        self,
        guarded: GuardedLLM,
        request: RequestLike,
        sampling: Any = None,
        *,
        policies: tuple[Policy, ...] | None = None,
        scoring: bool = False,
    ) -> Future[GuardedResult]:
        """Queue one request; the future resolves to its ``GuardedResult``."""
        job = EngineJob(guarded, request, sampling, policies, scoring)
        with self._lock:
            self._queue.put(job)
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._work, name="guardrail-engine-batcher", daemon=True
                )
                self._worker.start()
        return job.future

    def _work(self) -> None:
        while True:
            try:
                first = self._queue.get(timeout=self.idle_exit_s)
            except queue.Empty:
                with self._lock:  # submit() holds the lock while it queues and checks us
                    if self._queue.empty():
                        self._worker = None
                        return
                continue
            batch = self._collect(first)
            ordered = sorted(batch, key=_group_key)  # sorted() is stable: arrival order kept
            for _, group in groupby(ordered, key=_group_key):
                run_jobs(list(group))

    def _collect(self, first: EngineJob) -> list[EngineJob]:
        batch = [first]
        deadline = time.monotonic() + self.window_s
        while len(batch) < self.max_batch:
            remaining = deadline - time.monotonic()
            try:
                batch.append(
                    self._queue.get(timeout=remaining)
                    if remaining > 0
                    else self._queue.get_nowait()
                )
            except queue.Empty:
                break
        return batch


def _group_key(job: EngineJob) -> tuple[int, bool]:
    return id(job.guarded), job.scoring


_BATCHERS: weakref.WeakKeyDictionary[Any, EngineBatcher] = weakref.WeakKeyDictionary()
_BATCHERS_LOCK = threading.Lock()


def batcher_for(guarded: GuardedLLM) -> EngineBatcher:
    """The batcher of ``guarded``'s engine: every guard and model on one engine share it.

    Example:
        >>> same_engine = GuardedLLM.from_engine(guarded.engine)  # doctest: +SKIP
        >>> batcher_for(guarded) is batcher_for(same_engine)  # doctest: +SKIP
        True
    """
    with _BATCHERS_LOCK:
        batcher = _BATCHERS.get(guarded.engine)
        if batcher is None:
            batcher = _BATCHERS[guarded.engine] = EngineBatcher()
        return batcher
