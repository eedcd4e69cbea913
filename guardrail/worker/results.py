"""The probe's results between the end of a step and the caller.

Each step ends with its table on its way to the host (``FinishedStep``: a non-blocking copy and
its event). Where the caller listens (``guardrail.worker.outbox``), the step goes to the pusher,
which sends its results as soon as the copy lands. Otherwise, and for whatever the pusher could
not send, ``ResultStore.pop`` turns the finished steps into one result per request, by key,
waiting for their copies only then, and hands the popped ones over; at most
``MAX_STORED_RESULTS`` wait (the oldest go first). The store is shared by vLLM's thread (``add``,
``pop``) and the pusher's (``take``): ``lock`` guards it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from guardrail.protocol import MAX_STORED_RESULTS, ProbeErrorReason, ProbeResultData
from guardrail.worker.rows import FLAG_MESSAGES, FLAG_REASONS, PinnedTables, StepRows

__all__ = ["FinishedStep", "ResultStore"]


@dataclass
class FinishedStep:
    """One step's results on their way to the host: a non-blocking copy and its event."""

    rows: StepRows
    table: torch.Tensor  # [K, columns] float64 on the host (pinned on CUDA)
    buffer: torch.Tensor | None  # the pinned buffer ``table`` lives in (back to the pool)
    event: Any  # torch.cuda.Event, or None on CPU
    columns: dict[str, slice]
    seconds: float


class ResultStore:
    """Finished steps and the results made from them, by probe key, until popped."""

    def __init__(self, pp_size: int = 1) -> None:
        self.tables = PinnedTables()  # pinned buffers the steps' tables come back in, reused
        self.pp_size = pp_size  # with pipeline parallelism no stage decides early stops
        self.term_layers: list[int] = []  # the layers of the hidden terms, in table order
        self.results: OrderedDict[str, ProbeResultData] = OrderedDict()
        self.finished: deque[FinishedStep] = deque()
        self.lock = threading.Lock()
        self.discard = False  # another rank sends this engine's results: keep none
        # where finished steps go instead of ``finished`` (the pusher), and a wait for it
        self.push: Callable[[FinishedStep], None] | None = None
        self.flush: Callable[[], None] = lambda: None

    def take_buffer(self, size: int) -> torch.Tensor:
        """A pinned buffer for a step's table (``PinnedTables.take``, under the lock)."""
        with self.lock:
            return self.tables.take(size)

    def add(self, done: FinishedStep) -> None:
        """A finished step, its copy to the host possibly still running."""
        if self.push is not None:
            self.push(done)
            return
        with self.lock:
            self.finished.append(done)

    def pop(self, keys: list[str]) -> dict[str, ProbeResultData]:
        """Remove and return the stored results of ``keys`` (missing keys are absent). Waits
        for the pusher first: a result is then either sent already or here."""
        self.flush()
        with self.lock:
            while self.finished:
                self.keep(self.take(self.finished.popleft()))
            return {k: self.results.pop(k) for k in keys if k in self.results}

    def keep(self, results: dict[str, ProbeResultData]) -> None:
        """Store results until popped (under the lock): at most ``MAX_STORED_RESULTS``."""
        self.results.update(results)
        while len(self.results) > MAX_STORED_RESULTS:
            self.results.popitem(last=False)

    def take(self, done: FinishedStep) -> dict[str, ProbeResultData]:
        """A finished step's results by key (waits for its copy; call under the lock)."""
        if done.event is not None:
            done.event.synchronize()
        values = done.table.numpy()  # [K, columns] float64, one line per row in ``ok``
        rows = done.rows
        at = {i: r for r, i in enumerate(rows.ok)}
        results = {}
        for i, key in enumerate(rows.keys):
            result: ProbeResultData = {
                "num_prompt_tokens": rows.num_prompt_tokens[i],
                "probe_seconds": done.seconds / max(len(rows), 1),
            }
            tag = rows.tags[i] if i < len(rows.tags) else None
            if tag is not None:
                result["tag"] = tag
            row = values[at[i]] if i in at and values.size else None
            self._fill(result, rows, i, row, done.columns)
            results[key] = result
        if done.buffer is not None:  # every value was copied out of it
            self.tables.give(done.buffer)
        return results

    def _fill(
        self,
        result: ProbeResultData,
        rows: StepRows,
        i: int,
        row: np.ndarray | None,
        columns: dict[str, slice],
    ) -> None:
        """One row's result from its line of the step's table. Long float vectors travel as
        float64 bytes: one value for vLLM's serialiser, which with
        ``VLLM_ALLOW_INSECURE_SERIALIZATION`` set types every element of a list one by one
        (what that cost: docs/gpu.md)."""
        error, reason = rows.errors[i], rows.reasons[i]
        if error is None and row is not None:
            flags = row[columns["flags"]]
            raised = np.flatnonzero(flags)
            if raised.size:
                column = int(raised[0])
                error, reason = FLAG_MESSAGES[column], FLAG_REASONS[column]
        if rows.armed(i):
            focus = None
            if error is None and row is not None and "focus" in columns:
                focus = float(row[columns["focus"]][0])
            self._fill_stop(result, rows, i, focus)
        if error is not None or row is None:
            result["error"] = error or "probe: no score"
            result["reason"] = (reason or ProbeErrorReason.PROBE).value
            return
        result["stats"] = row[columns["stats"]].tobytes()  # ``head_order``, WIDTH per head
        terms = row[columns["terms"]].tolist()
        if terms:
            result["hidden"] = [[lay, t] for lay, t in zip(self.term_layers, terms, strict=True)]
        streams = [
            [int(n[6:]), row[s].tobytes()] for n, s in columns.items() if n.startswith("stream")
        ]
        if streams:
            result["hidden_states"] = streams
        if rows.has_data[i]:  # no data tokens: no mean stream to return
            means = [
                [int(n[4:]), row[s].tobytes()] for n, s in columns.items() if n.startswith("mean")
            ]
            if means:
                result["data_mean_states"] = means
        states = [
            [layer, len(by_row[i]), by_row[i].numpy().tobytes()]
            for layer, by_row in sorted(rows.token_states.items())
            if i in by_row
        ]
        if states:
            result["token_states"] = states

    def _fill_stop(
        self, result: ProbeResultData, rows: StepRows, i: int, focus: float | None
    ) -> None:
        """The stop decision the device made for row ``i``, recomputed from the same numbers
        (``focus`` None: the row was not scored, or no focus was computed)."""
        if self.pp_size > 1:
            return
        if focus is None:
            stopped = rows.stop_on_error[i]
        else:
            result["focus"] = focus
            stopped = focus <= float(rows.stop_below[i])  # type: ignore[arg-type]
        if stopped:
            result["stopped"] = True
