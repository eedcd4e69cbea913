"""The caller's end of pushed probe results (``guardrail.worker.outbox``): no pop round trip.

A ``ResultInbox`` binds a PULL socket in a private directory (mode 0700) and a thread receives
what the worker of tensor-parallel rank 0 pushes: first its ``hello`` with the head order, then
each step's results, by probe key and the ``tag`` of the call that sent the request (a result
of an earlier call with the same key is never taken). The engines ask with
``ResultInbox.take`` (blocking, for ``HookedLLM``) or ``ResultInbox.future`` (asyncio, for
``AsyncHookedLLM``); a result that did not arrive in time is popped as before, and one the pop
says is still on its way here (``in_transit``) is waited for up to ``IN_TRANSIT_WAIT_S``. A
result that arrived but was dropped untaken (more than ``MAX_STORED_RESULTS`` waiting) is
remembered as dropped, so asking for it returns at once without it (it is then missing), never
after those waits.

The engines set it up after installing the probe (``push_args``, ``accepted``), and fall back
to pops when the workers cannot reach the socket, e.g. an engine on another host.

Example (a worker's socket stands in for the engine):
    >>> import msgspec, zmq
    >>> inbox = ResultInbox()
    >>> push = zmq.Context.instance().socket(zmq.PUSH)
    >>> _ = push.connect(inbox.address)
    >>> push.send(msgspec.msgpack.encode({"hello": "h", "heads": [[0, 1]]}))
    >>> push.send(msgspec.msgpack.encode({"results": {"k": {"tag": "t", "num_prompt_tokens": 3,
    ...                                                      "probe_seconds": 0.0}}}))
    >>> inbox.hello = "h"
    >>> inbox.accepted([True]), inbox.heads
    (True, [[0, 1]])
    >>> inbox.take(["k"], "t", 5.0)["k"]["num_prompt_tokens"]
    3
    >>> push.close(); inbox.close()
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from guardrail.protocol import (
    MAX_STORED_RESULTS,
    PoppedResults,
    ProbeResultData,
)

__all__ = [
    "HELLO_TIMEOUT_S",
    "IN_TRANSIT_WAIT_S",
    "PUSH_WAIT_S",
    "ResultInbox",
    "in_transit",
    "no_push_args",
    "pushed",
]

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0
"""How long ``start_push`` waits for the worker's hello before falling back to pops."""
PUSH_WAIT_S = 0.5
"""How long a caller waits for a pushed result after the request's output arrived, before it
pops instead (the result normally arrives first; this bounds a lost one)."""
IN_TRANSIT_WAIT_S = 60.0
"""How long a caller waits for results a pop says the worker's pusher took
(``PoppedResults.pushed``): they are on their way over a local socket, and a large one (the
streams calibration reads, hundreds of MB a step) takes seconds; past this, or once the engine
is dead, they are missing."""
_POLL_MS = 100  # the receiving thread checks for ``close`` this often

Key = tuple[str, str]  # (probe key, tag)


class ResultInbox:
    """Pushed results by (key, tag), until taken (see the module docstring)."""

    def __init__(self) -> None:
        import msgspec
        import zmq

        self._dir = tempfile.mkdtemp(prefix="guardrail-results-")  # mode 0700: this user only
        self.address = f"ipc://{self._dir}/socket"
        self._context = zmq.Context()  # its own: closing it never touches vLLM's sockets
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)  # never drop a result
        self._socket.bind(self.address)
        self._decode = msgspec.msgpack.Decoder().decode
        self._changed = threading.Condition()
        self._arrived: OrderedDict[Key, ProbeResultData] = OrderedDict()
        # results dropped untaken (the oldest, past MAX_STORED_RESULTS): asking for one returns
        # at once, however often (a caller asks, pops, then asks again for what the pop says
        # was sent); the record keeps the last 4 x MAX_STORED_RESULTS keys (one it forgot is
        # waited for again)
        self._dropped: OrderedDict[Key, None] = OrderedDict()
        self._warned_dropping = False
        self._futures: dict[Key, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._hellos: set[str] = set()
        self.hello = uuid.uuid4().hex  # what the worker sends first, once it is connected
        self.heads: list[list[int]] = []  # the order of every result's stats (from the hello)
        self.received = 0  # results received (for tests and diagnostics)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="guardrail-inbox", daemon=True)
        self._thread.start()

    @property
    def push_args(self) -> tuple[str, str]:
        """``RPC_PUSH_RESULTS`` arguments that make the workers push here."""
        return (self.address, self.hello)

    def accepted(self, ranks: Sequence[bool]) -> bool:
        """Whether results will come here: some rank answered ``RPC_PUSH_RESULTS`` that it
        pushes (``ranks``), and its hello arrived within ``HELLO_TIMEOUT_S`` (a worker on
        another host cannot reach the socket). Otherwise the caller stops the push
        (``no_push_args``), closes this inbox and pops results."""
        if not any(ranks):
            return False  # pipeline parallelism: every stage's results are popped
        with self._changed:
            if self._changed.wait_for(lambda: self.hello in self._hellos, HELLO_TIMEOUT_S):
                return True
        log.warning(
            "guardrail: the workers cannot push probe results to this process; they are "
            "popped after each request instead (one round trip more)"
        )
        return False

    # -- asking ----------------------------------------------------------------------------------

    def take(
        self,
        keys: Sequence[str],
        tag: str,
        timeout: float,
        stop: Callable[[], bool] | None = None,
    ) -> dict[str, ProbeResultData]:
        """The results of ``keys`` sent with ``tag``, waiting up to ``timeout`` seconds for all
        of them, or until ``stop()`` is true (checked every ``_POLL_MS``: a dead engine sends
        nothing more); those that did not arrive, or arrived and were dropped untaken, are
        absent (the dropped ones are not waited for)."""
        wanted = [(k, tag) for k in keys]
        deadline = time.monotonic() + timeout
        with self._changed:
            while not all(w in self._arrived or w in self._dropped for w in wanted):
                left = deadline - time.monotonic()
                if left <= 0 or (stop is not None and stop()):
                    break
                self._changed.wait(min(left, _POLL_MS / 1000) if stop is not None else left)
            return {k: self._arrived.pop((k, t)) for k, t in wanted if (k, t) in self._arrived}

    def future(self, key: str, tag: str) -> asyncio.Future[ProbeResultData]:
        """A future of the running loop for the result of ``key`` sent with ``tag``."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[ProbeResultData] = loop.create_future()
        with self._changed:
            found = self._arrived.pop((key, tag), None)
            if found is None:
                self._futures[(key, tag)] = (loop, future)
        if found is not None:
            future.set_result(found)
        return future

    def unwait(self, key: str, tag: str) -> None:
        """Stop the ``future`` of ``key`` sent with ``tag``; a result arriving later is kept
        for ``take``."""
        with self._changed:
            self._futures.pop((key, tag), None)

    def forget(self, key: str, tag: str) -> None:
        """Stop waiting for the result of ``key`` sent with ``tag``, and drop it if it came."""
        with self._changed:
            self._futures.pop((key, tag), None)
            self._arrived.pop((key, tag), None)
            self._dropped.pop((key, tag), None)

    def drop(self, tag: str) -> None:
        """Drop every result of the call ``tag`` (a failed call)."""
        with self._changed:
            for key in [k for k in self._arrived if k[1] == tag]:
                del self._arrived[key]
            for key in [k for k in self._dropped if k[1] == tag]:
                del self._dropped[key]

    # -- receiving -------------------------------------------------------------------------------
    def _run(self) -> None:
        socket = self._socket
        while not self._closing:
            try:
                if not socket.poll(_POLL_MS):
                    continue
                message = self._decode(socket.recv())
            except Exception:  # closed under us, or a message that is not ours: never fatal
                if self._closing:
                    return
                log.exception("guardrail: a pushed probe result could not be read")
                continue
            self._receive(message)

    def _receive(self, message: dict[str, Any]) -> None:
        resolved = []
        with self._changed:
            if "hello" in message:
                self.heads = message.get("heads") or []
                self._hellos.add(message["hello"])
            for key, result in (message.get("results") or {}).items():
                tag = result.get("tag")
                if not isinstance(tag, str):
                    continue
                self.received += 1
                waiting = self._futures.pop((key, tag), None)
                if waiting is not None:
                    resolved.append(((key, tag), waiting, result))
                    continue
                self._arrived[(key, tag)] = result
                while len(self._arrived) > MAX_STORED_RESULTS:  # never taken: oldest go
                    self._drop_oldest()
            self._changed.notify_all()
        for (key, tag), (loop, future), result in resolved:
            loop.call_soon_threadsafe(self._settle, future, (key, tag), result)

    def _drop_oldest(self) -> None:
        """Drop the oldest untaken result, remembering that it came (under the lock)."""
        dropped, _ = self._arrived.popitem(last=False)
        if not self._warned_dropping:
            self._warned_dropping = True
            log.warning(
                "guardrail: more than %d pushed probe results were never taken; the oldest are "
                "dropped and their requests come back missing",
                MAX_STORED_RESULTS,
            )
        self._dropped[dropped] = None
        while len(self._dropped) > 4 * MAX_STORED_RESULTS:  # keys only: small
            self._dropped.popitem(last=False)

    def _settle(self, future: asyncio.Future[Any], key: Key, result: ProbeResultData) -> None:
        """Give ``result`` to its future, or keep it for ``take`` if that future was given up
        (cancelled by a timeout) in the meantime."""
        if not future.done():
            future.set_result(result)
            return
        with self._changed:
            self._arrived[key] = result
            self._changed.notify_all()

    def close(self) -> None:
        """Stop receiving, close the socket and remove its directory. Idempotent."""
        if self._closing:
            return
        self._closing = True
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * _POLL_MS / 1000)
        self._socket.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def pushed(inbox: ResultInbox, results: dict[str, ProbeResultData]) -> PoppedResults:
    """Pushed results in the shape of one rank's pop, for ``ProbeClient.result``."""
    return {"heads": inbox.heads, "results": results}


def in_transit(per_rank: Sequence[PoppedResults]) -> list[str]:
    """The keys that a pop found with no rank but that a rank's pusher took
    (``PoppedResults.pushed``): the caller waits for them (``IN_TRANSIT_WAIT_S``)."""
    popped = {k for rank in per_rank for k in rank["results"]}
    return sorted({k for rank in per_rank for k in rank.get("pushed", [])} - popped)


def no_push_args() -> tuple[None, str]:
    """``RPC_PUSH_RESULTS`` arguments that stop pushing."""
    return (None, "")
