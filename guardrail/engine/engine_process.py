"""The vLLM engine's processes, supervised: ``HookedLLM``'s engine handle and the process
supervisor of both engines (one call at a time, dead engines reported within a second, nothing
left behind by ``close``). The one caller-side module that reads vLLM's engine-client internals.
(Formerly ``guardrail.engine.vllm_client``, a name that still imports: it is no client.)

Why it exists. vLLM 0.32's synchronous multi-process client (``SyncMPClient``, behind
``vllm.LLM``) never wakes a waiting caller when the engine-core process dies: its monitor
thread marks the client dead and shuts it down, which stops the output thread *without*
queueing an error, so ``LLM.generate`` waits on ``outputs_queue.get()`` (and ``collective_rpc``
on its utility future) forever; only the next call raises ``EngineDeadError`` from
``ensure_alive``. No public API reports the death or lists the engine's processes, so this
module reads the client's fields (``resources.engine_manager``, ``resources.engine_dead``,
``outputs_queue``, ``utility_results``) and imports vLLM's ``EngineDeadError`` from
``vllm.v1``. import-linter's ``vllm-internals`` contract allows this module, and no other one
outside ``guardrail.worker``.

What it does:

- ``EngineHandle`` holds the ``vllm.LLM`` and a re-entrant lock: ``call()`` serialises every
  call (a second thread waits; vLLM's sync client must never be entered by two threads: on the
  multi-process engine that is a native libzmq assertion, in-process it corrupts memory),
  refuses closed or dead engines, and turns vLLM's failures of a dead engine into this
  library's ``EngineDeadError``. It holds no reference to its ``HookedLLM``, so
  ``weakref.finalize`` can close it.
- ``EngineSupervisor`` records the engine's processes when the engine has started (the
  engine-core process and its descendants, e.g. CPU's ``VLLM::Worker``) and the shared-memory
  segments they map. One daemon thread blocks in ``multiprocessing.connection.wait`` on their
  exit (process sentinels and Linux pidfds, plus a pipe that ``closing`` writes to): no polling, no
  cost while the engine lives. When one of them dies, the thread marks the client dead, fails
  every pending utility call, queues ``EngineDeadError`` for the output loop, and shuts the
  client down, so the running call raises at once and later calls raise without waiting; then
  it ends what is left of the engine's processes and unlinks their shared memory (``_reap``),
  so a dead engine holds no memory even before it is closed.
- The same supervisor watches vLLM's ``AsyncLLM`` (``AsyncHookedLLM``), whose engine client
  (``AsyncMPClient``) has the same ``resources`` and process manager. Its waiters are asyncio
  futures and request queues, which only the event loop may touch: the supervisor wakes them
  on that loop (``call_soon_threadsafe``), failing pending utility calls (``collective_rpc``,
  which vLLM never wakes when its engine core dies) and putting the error in every request's
  output queue (``output_processor.propagate_error``). ``wake_waiters`` does the same when
  ``AsyncHookedLLM.close`` shuts the engine down under running streams, which would otherwise
  wait forever (vLLM's shutdown cancels the task that feeds them).
- ``EngineHandle.close`` runs vLLM's own shutdown (``SyncMPClient.shutdown``: SIGTERM to the
  engine core, which stops its workers, tears down and exits) with a budget of
  ``SHUTDOWN_TIMEOUT_S`` instead of vLLM's 5 s (see "Closing" below).
- ``EngineSupervisor.closing`` (before vLLM's shutdown: the exits that follow are no death) and
  ``EngineSupervisor.stop`` (from ``HookedLLM.close`` and ``AsyncHookedLLM.close``, after vLLM's
  own shutdown), which waits for the recorded processes to exit, kills what is left, reaps them
  and unlinks the shared-memory segments they left behind, so the next engine starts in a clean
  process.
- ``EngineHandle.start_arguments``: the engine arguments ``HookedLLM`` starts vLLM with,
  plus ``guardrail.engine.defaults.cpu_defaults`` when vLLM runs on the CPU.
- ``abort_unfinished`` removes requests a failed or interrupted ``generate`` left in the engine,
  so they never mix into the next call's outputs.

The in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) has no process to watch; there the
supervisor is inert.

Closing. vLLM's clean exit of an idle engine took about 4.5 s on a 2-core CPU machine, nearly all
of it Python's garbage collection at interpreter exit: ``EngineCore.shutdown``
(vllm/v1/engine/core.py, ``gc.unfreeze()``) and ``Worker.shutdown`` (vllm/v1/worker/gpu_worker.py,
which ``CPUWorker`` inherits) hand the whole start-up heap (~700,000 objects: torch, vLLM, the
model) back to the collector, whose final full collections then took ~2 s in each process (vLLM
re-freezes it only on ROCm, core.py ``run_engine_core``; upstream issue vllm-project/vllm#48620).
The engine core waits for its worker to exit before its own teardown
(``MultiprocExecutor._ensure_worker_termination``), so the two run one after the other. The engines
this library starts therefore spawn their processes under ``EngineHandle.spawning``
(``ENGINE_ENV=1``), and the vLLM plugin ``guardrail.worker.lifecycle`` freezes the heap of each of
them at exit, as vLLM does on ROCm: close takes ~1.5 s (docs/startup.md). What is left is vLLM's
own explicit ``gc.collect()`` in each shutdown (worker ~0.45 s, engine core ~0.4 s, one after the
other), which no extension point reaches (open upstream: vllm-project/vllm#49082). vLLM's process
manager gives the engine core 5 s (``vllm.v1.utils.shutdown``: ``timeout=None`` means 5.0) and then
kills it and its worker ("force killing remaining processes"); on a busy machine the exit can take
longer than that, so ``close`` gives vLLM's shutdown ``SHUTDOWN_TIMEOUT_S``: the processes finish
their own cleanup and nothing is killed. Python's resource tracker, which the engine's processes
share with this one, then must not list any of their ``/dev/shm`` segments, or it warns at this
process's exit ("leaked shared_memory objects"): ``stop`` unlinks what they left and drops
registrations they left for segments that are gone (``_unlink_shared_memory``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from guardrail.engine.defaults import cpu_defaults, cpu_environment
from guardrail.errors import EngineClosedError, EngineDeadError, GuardrailError
from guardrail.protocol import ENGINE_ENV

__all__ = [
    "EngineHandle",
    "EngineSupervisor",
    "SerialLLM",
    "abort_unfinished",
    "is_engine_dead_error",
    "shutdown_engine",
]

SHM_DIR = Path("/dev/shm")
PROCESS_EXIT_TIMEOUT_S = 10.0
"""How long ``stop`` waits for the engine's processes to exit before it kills them."""
EXIT_CODE_WAIT_S = 1.0
"""How long the watch waits for a dead engine process's exit code, to name its signal."""
SHUTDOWN_TIMEOUT_S = 60.0
"""How long vLLM's shutdown lets the engine core (and its workers) exit on their own before it
kills them. vLLM's own default, 5 s, is shorter than a clean exit takes on a busy CPU machine
(module docstring, "Closing"); this bounds only an engine that hangs."""


def is_engine_dead_error(exc: BaseException) -> bool:
    """True for vLLM's own ``EngineDeadError`` (the engine core is gone, unrecoverable)."""
    from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

    return isinstance(exc, VllmEngineDeadError)


def shutdown_engine(client: Any, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
    """vLLM's own shutdown of an engine client (``EngineCoreClient.shutdown``; idempotent), with
    ``timeout`` s for the engine's processes to exit before vLLM kills them."""
    shutdown = getattr(client, "shutdown", None)
    if callable(shutdown):
        shutdown(timeout=timeout)


def abort_unfinished(llm: Any) -> None:
    """Abort every request still in ``llm``'s engine (calls are serialised, so after a failed
    or interrupted ``generate`` every unfinished request is that call's)."""
    engine = llm.llm_engine
    ids = list(getattr(engine.output_processor, "request_states", {}))
    if ids:
        engine.abort_request(ids, internal=True)


def _shm_mapped_by(pid: int | str) -> set[str]:
    """Names of the /dev/shm files a process maps (empty when unreadable)."""
    names = set()
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
            if len(fields) == 6 and fields[5].startswith(f"{SHM_DIR}/"):
                names.add(fields[5][len(str(SHM_DIR)) + 1 :].removesuffix(" (deleted)"))
    return names


def _describe_exit(name: str, pid: int, exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        import signal

        with contextlib.suppress(ValueError):
            return f"{name} (pid {pid}) was killed by {signal.Signals(-exitcode).name}"
    if exitcode is not None:
        return f"{name} (pid {pid}) exited with code {exitcode}"
    return f"{name} (pid {pid}) exited"


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class EngineSupervisor:
    """Watches one engine's processes (see the module docstring): a ``vllm.LLM``, or vLLM's
    ``AsyncLLM`` with ``loop``, the event loop its output task runs on.

    ``dead`` turns True within milliseconds of an engine process dying; ``reason`` says which
    one and how. ``stop`` ends the watch and leaves no process or shared memory behind.
    """

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop | None = None) -> None:
        import psutil

        engine = getattr(llm, "llm_engine", llm)  # vllm.LLM's LLMEngine; AsyncLLM is its own
        self._client: Any = getattr(engine, "engine_core", None)
        self._loop = loop
        # AsyncLLM: the per-request output queues its streams wait on (woken on ``loop``)
        self._requests: Any = getattr(engine, "output_processor", None) if loop else None
        self._reap_lock = threading.Lock()
        manager = getattr(getattr(self._client, "resources", None), "engine_manager", None)
        self._children: list[Any] = list(getattr(manager, "processes", None) or [])
        self.processes: list[psutil.Process] = []
        for proc in self._children:
            with contextlib.suppress(psutil.Error, ValueError):
                core = psutil.Process(proc.pid)
                self.processes += [core, *core.children(recursive=True)]
        self._names: dict[int, str] = {}
        for p in self.processes:
            with contextlib.suppress(psutil.Error):
                self._names[p.pid] = p.name()
        own = _shm_mapped_by("self")
        self.shared_memory = sorted(
            {name for p in self.processes for name in _shm_mapped_by(p.pid)} - own
        )
        self.reason: str | None = None
        self._stopping = threading.Event()
        self._stopped = False
        self._wake: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        if self._children:
            self._wake = os.pipe()
            self._thread = threading.Thread(
                target=self._watch, name="guardrail-engine-supervisor", daemon=True
            )
            self._thread.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    @property
    def watching(self) -> bool:
        """True while the watch runs: no death seen yet, or one it is still describing (vLLM's
        own monitor may report the death a moment before ``reason`` is set)."""
        return (
            self._thread is not None
            and self._thread.is_alive()
            and self.reason is None
            and not self._stopping.is_set()
        )

    @property
    def dead(self) -> bool:
        """True when an engine process died (or vLLM found its engine core dead)."""
        if self.reason is not None:
            return True
        resources = getattr(self._client, "resources", None)
        return bool(getattr(resources, "engine_dead", False)) and not self._stopping.is_set()

    # -- the watch -------------------------------------------------------------------------------
    def _watch(self) -> None:
        from multiprocessing.connection import wait

        assert self._wake is not None
        waitables: list[Any] = [p.sentinel for p in self._children]
        pidfds: dict[int, Any] = {}
        for proc in self.processes[len(self._children) :]:  # descendants: not our children
            with contextlib.suppress(OSError, AttributeError):
                pidfds[os.pidfd_open(proc.pid)] = proc
        try:
            ready = wait([*waitables, *pidfds, self._wake[0]])
        finally:
            for fd in pidfds:
                os.close(fd)
        if self._stopping.is_set():
            return
        try:
            reason = self._which(ready, pidfds)
        except Exception:  # the watch must end in _mark_dead whatever happens
            reason = "an engine process exited"
        self._mark_dead(reason)
        with contextlib.suppress(Exception):  # a dead engine leaves nothing, closed or not yet
            self._reap(PROCESS_EXIT_TIMEOUT_S)

    def _which(self, ready: Sequence[Any], pidfds: dict[int, Any]) -> str:
        for proc in self._children:
            if proc.sentinel in ready:
                # vLLM's own monitor may be reaping it right now: its exit code lands on the
                # shared Popen object a moment after (seen late on a loaded 2-core machine)
                deadline = time.monotonic() + EXIT_CODE_WAIT_S
                while proc.exitcode is None and time.monotonic() < deadline:
                    proc.join(0.05)
                return _describe_exit(proc.name, proc.pid, proc.exitcode)
        for fd, proc in pidfds.items():
            if fd in ready:
                return _describe_exit(self._names.get(proc.pid, "process"), proc.pid, None)
        return "an engine process exited"

    def _mark_dead(self, reason: str) -> None:
        """Wake every waiter with vLLM's ``EngineDeadError``, then shut the client down."""
        self.reason = reason
        # Set the flag first: a call that checks ``ensure_alive`` after this raises, and a call
        # that checked before registered its utility future before, so the waking sees it.
        self._client.resources.engine_dead = True
        self.wake_waiters()
        with contextlib.suppress(Exception):  # idempotent in vLLM; kills what is left
            shutdown_engine(self._client)

    def wake_waiters(self) -> None:
        """Fail every call waiting on the engine with vLLM's ``EngineDeadError``: pending
        utility calls, and the output loop (``vllm.LLM``) or every request's output queue
        (``AsyncLLM``; done on its event loop, now when this runs on it, else as soon as the
        loop runs; a closed loop has nobody waiting)."""
        if self._loop is None or _running_loop() is self._loop:
            self._fail_waiters()
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed
            self._loop.call_soon_threadsafe(self._fail_waiters)

    def _fail_waiters(self) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

        client = self._client
        pending = getattr(client, "utility_results", {})
        for call_id, future in list(pending.items()):
            pending.pop(call_id, None)
            with contextlib.suppress(Exception):  # already resolved: nothing to wake
                future.set_exception(VllmEngineDeadError())
        if self._requests is not None:  # AsyncLLM: each stream's queue (its feeder may be gone)
            with contextlib.suppress(Exception):
                self._requests.propagate_error(VllmEngineDeadError())
            return
        outputs = getattr(client, "outputs_queue", None)
        if outputs is not None:
            outputs.put_nowait(VllmEngineDeadError())

    def abandon(self, reason: str) -> None:
        """Fail a call that is still waiting on the engine (closing under it at exit)."""
        if self._thread is not None and self.reason is None:
            self._mark_dead(reason)

    # -- the end ---------------------------------------------------------------------------------
    def closing(self) -> None:
        """Before vLLM's shutdown: the processes' exits that follow are no death, so the watch
        ends here (it neither marks the engine dead nor ends processes vLLM is stopping)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._wake is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake[1], b"x")

    def stop(self, timeout: float = PROCESS_EXIT_TIMEOUT_S) -> None:
        """After vLLM's shutdown: end the watch, make sure every engine process is gone (killed
        after ``timeout`` s) and reaped, and unlink the shared memory they left. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.closing()
        self._reap(timeout)
        if self._thread is not None:
            self._thread.join(1.0)
        if self._wake is not None:
            for fd in self._wake:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._wake = None

    def _reap(self, timeout: float) -> None:
        """Wait for every engine process to exit (kill it after ``timeout`` s), reap it, and
        unlink the shared memory they left. From ``stop``, or from the watch once the engine
        died (one at a time; a second run finds nothing left to do)."""
        with self._reap_lock:
            self._end_processes(timeout)
            self._unlink_shared_memory()

    def _end_processes(self, timeout: float) -> None:
        import psutil

        deadline = time.monotonic() + timeout
        for proc in self._children:  # our children: join reaps them (no zombie left)
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        # Descendants (workers) are not our children; vLLM's shutdown stops them, except when
        # their engine core died first: then nobody will, so end them here (they serve no one).
        others = [p for p in self.processes[len(self._children) :] if self._running(p)]
        for p in others:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        deadline = min(deadline, time.monotonic() + 2.0)
        while any(self._running(p) for p in others) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in others:
            if self._running(p):
                with contextlib.suppress(psutil.Error):
                    p.kill()
        deadline = time.monotonic() + 5.0
        while any(self._running(p) for p in others) and time.monotonic() < deadline:
            time.sleep(0.05)

    @staticmethod
    def _running(proc: Any) -> bool:
        import psutil

        try:
            return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False

    def _unlink_shared_memory(self) -> None:
        """Unlink the segments the engine's processes mapped and left (vLLM's message queues:
        a process killed before its own cleanup cannot unlink them), and make sure the resource
        tracker they share with this process no longer lists any of them.

        vLLM's ``ShmRingBuffer`` registers its segment with that tracker when created and
        unregisters it in ``unlink``, from ``__del__``. A creator that unlinked its segment but
        never sent the unregistering message (killed between the two, or an ``__del__`` that
        failed during interpreter exit) leaves the tracker listing a segment that is gone: at
        this process's exit it warns "leaked shared_memory objects" and fails to unlink it ("No
        such file or directory"). The engine's processes are gone when this runs, so their
        messages are all in the tracker's pipe ahead of these."""
        from multiprocessing import resource_tracker, shared_memory

        still_mapped = _shm_mapped_by("self")
        # Spawned engine processes share this process's tracker (it runs: spawning started it);
        # never start one here just for this.
        shares_tracker = getattr(resource_tracker._resource_tracker, "_fd", None) is not None
        for name in self.shared_memory:
            if not name.startswith("psm_") or name in still_mapped:
                continue
            if (SHM_DIR / name).exists():
                with contextlib.suppress(OSError, ValueError):
                    segment = shared_memory.SharedMemory(name=name)
                    segment.close()
                    segment.unlink()  # also drops it from the resource tracker: no warning at exit
            elif shares_tracker:  # unlinked by its creator: drop a registration it may have left
                # (a register, then an unregister: the tracker ends without the name either way,
                # where an unregister alone of a name it does not list prints a KeyError)
                resource_tracker.register("/" + name, "shared_memory")
                resource_tracker.unregister("/" + name, "shared_memory")
        # Named semaphores of joblib's loky in the worker carry their creator's pid; they are
        # registered with the resource tracker the engine processes share with this one.
        for pid in self.pids:
            for path in SHM_DIR.glob(f"sem.loky-{pid}-*"):
                with contextlib.suppress(OSError):
                    path.unlink()
                    resource_tracker.unregister("/" + path.name.removeprefix("sem."), "semaphore")


class EngineHandle:
    """One ``vllm.LLM``, the lock that serialises calls to it, and its supervisor.

    Holds no reference to the ``HookedLLM`` that owns it, so ``weakref.finalize`` can close an
    engine nobody closed (when its ``HookedLLM`` is collected, or at interpreter exit).
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()  # one call at a time; re-entrant for nested engine calls
        self.llm: Any = None
        self.supervisor: EngineSupervisor | None = None
        self.closed = False

    def watch(self) -> None:
        """Start watching the processes of ``llm`` (set it first, once the engine started)."""
        self.supervisor = EngineSupervisor(self.llm)

    @property
    def dead(self) -> bool:
        return self.supervisor is not None and self.supervisor.dead

    @contextlib.contextmanager
    def call(self) -> Iterator[Any]:
        """Hold the engine for one call and yield the ``vllm.LLM``: waits for another thread's
        call; raises ``EngineClosedError`` / ``EngineDeadError`` when the engine cannot answer,
        and turns vLLM's failures of a dead engine into ``EngineDeadError``."""
        with self.lock:
            if self.closed or self.llm is None:
                raise EngineClosedError("the engine was closed; start a new one")
            if self.dead:
                raise EngineDeadError(f"the engine is dead ({self._reason()}); start a new one")
            try:
                yield self.llm
            except GuardrailError:
                raise
            except Exception as exc:
                if is_engine_dead_error(exc) or self.dead:
                    raise EngineDeadError(
                        f"the engine died during the call ({self._reason()}); start a new one"
                    ) from exc
                raise

    def _reason(self) -> str:
        reason = self.supervisor.reason if self.supervisor is not None else None
        return reason or "vLLM reported its engine core dead; its log says why"

    def serial_llm(self, tokenizer: Any) -> SerialLLM:
        return SerialLLM(self, tokenizer)

    @staticmethod
    @contextlib.contextmanager
    def spawning() -> Iterator[None]:
        """Around the start of a vLLM engine: the processes it spawns inherit ``ENGINE_ENV=1``,
        which arms the plugin ``guardrail.worker.lifecycle`` in them (they skip the collection
        of their heap at exit, "Closing" above, and stop when this process is gone). The
        variable is restored afterwards."""
        before = os.environ.get(ENGINE_ENV)
        os.environ[ENGINE_ENV] = "1"
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(ENGINE_ENV, None)
            else:
                os.environ[ENGINE_ENV] = before

    @staticmethod
    def start_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
        """The engine arguments to start vLLM with: ``arguments`` plus, when vLLM runs on the
        CPU, the start-up defaults of ``guardrail.engine.defaults`` for what they leave unset
        (and its CPU environment variables, where unset)."""
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            cpu_environment()
            return cpu_defaults(arguments)
        return dict(arguments)

    def close(self, wait_s: float | None = None) -> None:
        """Shut vLLM down, then make sure no engine process or shared memory is left.

        Waits for a running call to finish; with ``wait_s``, at most that long, after which a
        multi-process engine is shut down under the call (which then raises
        ``EngineDeadError``)."""
        locked = self.lock.acquire(timeout=-1 if wait_s is None else wait_s)
        try:
            if self.closed:
                return
            self.closed = True
            llm, self.llm = self.llm, None
            supervisor = self.supervisor
            if supervisor is not None and not locked:
                supervisor.abandon("the engine was closed while a call was running")
            if supervisor is not None:
                supervisor.closing()
            try:
                shutdown_engine(getattr(getattr(llm, "llm_engine", None), "engine_core", None))
            finally:
                if supervisor is not None:
                    supervisor.stop()
        finally:
            if locked:
                self.lock.release()


class SerialLLM:
    """The ``vllm.LLM`` as a component (``SteeringClient``) sees it: each call goes through
    ``EngineHandle.call`` (serialised, dead engines reported as ``EngineDeadError``)."""

    def __init__(self, handle: EngineHandle, tokenizer: Any) -> None:
        self._handle = handle
        self._tokenizer = tokenizer

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        with self._handle.call() as llm:
            return llm.generate(*args, **kwargs)

    def collective_rpc(self, *args: Any, **kwargs: Any) -> Any:
        with self._handle.call() as llm:
            return llm.collective_rpc(*args, **kwargs)

    def get_tokenizer(self) -> Any:
        return self._tokenizer
