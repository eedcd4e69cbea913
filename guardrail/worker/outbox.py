"""Results pushed to the caller as soon as they reach the host: no pop round trip.

A pop (``RPC_POP_RESULTS``) is a round trip through vLLM's engine core, which serves it only
between two engine steps: on the H200 it took 1.3-2 ms after a batch-1 generate, and under load a
whole step, on the way to each request's first output. Instead, where the caller listens on a
socket (``RPC_PUSH_RESULTS``), the worker of tensor-parallel rank 0 hands every finished step to
a ``ResultPusher``: its thread waits for the step's copy to the host (off vLLM's thread), turns
the table into results and sends them, msgpack-encoded (``PushedResults``). The results are on
the host before the step's sampled tokens are (same stream, earlier), so they normally reach the
caller before the request's output does. Only results whose spec carries the caller's ``tag``
are pushed; the others, and what cannot be sent, stay in the store for a pop.

A large step (calibration's streams at every data token: hundreds of MB at the 8B shape) can
take longer to send than the caller waits for it before popping. The pusher therefore remembers
the keys handed to it (``in_transit``), and a pop names those it did not find in the store but
the pusher took (``PoppedResults.pushed``): the caller then keeps waiting for them on its socket
instead of calling them missing.

Example (a worker with no GPU, a caller's socket):
    >>> import zmq, msgspec
    >>> from guardrail.worker.results import ResultStore
    >>> pull = zmq.Context.instance().socket(zmq.PULL)
    >>> port = pull.bind_to_random_port("tcp://127.0.0.1")
    >>> pusher = ResultPusher(f"tcp://127.0.0.1:{port}", ResultStore(), "t1", [[0, 1]])
    >>> msgspec.msgpack.decode(pull.recv())
    {'hello': 't1', 'heads': [[0, 1]]}
    >>> pusher.close(); pull.close()
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from guardrail.protocol import MAX_STORED_RESULTS, ProbeResultData, PushedResults
from guardrail.worker.results import FinishedStep, ResultStore

__all__ = ["ResultPusher"]

FLUSH_TIMEOUT_S = 10.0
"""How long a pop waits for the pusher to finish the steps handed to it."""


class ResultPusher:
    """Sends each finished step's results to ``address`` from its own thread (see the module
    docstring); installed as ``store.push``. ``hello`` and ``heads`` go first, once."""

    def __init__(self, address: str, store: ResultStore, hello: str, heads: list[list[int]]):
        import msgspec
        import zmq

        self._encode = msgspec.msgpack.Encoder().encode
        self._noblock = zmq.NOBLOCK
        self._socket: Any = zmq.Context.instance().socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)  # closing never waits for an absent caller
        self._socket.setsockopt(zmq.SNDHWM, 0)  # no message limit: results are never dropped
        self._socket.connect(address)
        self._store = store
        self._queue: queue.SimpleQueue[FinishedStep | None] = queue.SimpleQueue()
        self._pending = 0  # steps handed over and not yet sent (or kept)
        self._idle = threading.Condition()  # also guards ``_taken``
        self._taken: OrderedDict[str, None] = OrderedDict()  # tagged keys handed over (bounded)
        self.sent = 0  # results sent (for tests and diagnostics)
        self._socket.send(self._encode(PushedResults(hello=hello, heads=heads)), self._noblock)
        self._thread = threading.Thread(target=self._run, name="guardrail-results", daemon=True)
        self._thread.start()
        store.push, store.flush = self.submit, self.flush

    def submit(self, done: FinishedStep) -> None:
        """Hand over a finished step (vLLM's thread; never blocks)."""
        rows = done.rows
        with self._idle:
            self._pending += 1
            for key, tag in zip(rows.keys, rows.tags, strict=False):
                if tag is not None:
                    self._taken[key] = None
            while len(self._taken) > MAX_STORED_RESULTS:
                self._taken.popitem(last=False)
        self._queue.put(done)

    def in_transit(self, keys: Sequence[str]) -> list[str]:
        """Those of ``keys`` handed to the pusher (sent, or still being sent), forgotten here
        once asked for. A result the pusher could not send went back to the store, so a pop
        that finds it there does not ask for it here."""
        with self._idle:
            taken = [k for k in keys if k in self._taken]
            for key in taken:
                del self._taken[key]
            return taken

    def flush(self) -> None:
        """Wait until every step handed over was sent or kept in the store."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0, timeout=FLUSH_TIMEOUT_S)

    def close(self) -> None:
        """Send what is pending, stop the thread, close the socket; the store pops again."""
        self._store.push, self._store.flush = None, lambda: None
        self._queue.put(None)
        self._thread.join(timeout=FLUSH_TIMEOUT_S)
        self._socket.close(linger=0)

    def _run(self) -> None:
        while (done := self._queue.get()) is not None:
            try:
                self._send(done)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _send(self, done: FinishedStep) -> None:
        if done.event is not None:
            done.event.synchronize()  # releases the GIL: vLLM's thread runs meanwhile
        store = self._store
        with store.lock:
            results = store.take(done)
        # a result without the caller's tag was asked for by a pop (a raw vLLM request)
        untagged = {k: r for k, r in results.items() if "tag" not in r}
        tagged = {k: r for k, r in results.items() if "tag" in r}
        if tagged:
            try:
                self._socket.send(self._encode(PushedResults(results=tagged)), self._noblock)
                self.sent += len(tagged)
            except Exception:  # the caller is gone or not listening: a pop still finds them
                untagged.update(tagged)
        if untagged:
            self._keep(untagged)

    def _keep(self, results: dict[str, ProbeResultData]) -> None:
        with self._store.lock:
            self._store.keep(results)
