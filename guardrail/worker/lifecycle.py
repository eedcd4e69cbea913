"""A vLLM general plugin for the processes of a guarded engine: exit fast, never outlive the caller.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes (the engine core
in ``EngineCore.__init__``, each worker in ``WorkerWrapperBase.init_worker``; pyproject.toml
registers ``register`` below). It acts only in the processes of an engine started by this library
(the caller sets ``ENGINE_ENV=1`` while vLLM spawns them: ``guardrail.engine.engine_process``), and
only in vLLM's engine-core and worker processes, never in the caller's process or in other vLLM
engines of the same environment. There it does two things.

Exit without collecting the heap (engine core and workers; ``FAST_EXIT_ENV=0`` turns it off).
vLLM's shutdown (``EngineCore.shutdown``, ``Worker.shutdown``) calls ``gc.unfreeze()``, handing
the whole start-up heap (~700,000 objects: torch, vLLM, the model) back to the collector, and
tears down everything that holds an outside resource (message queues and their ``/dev/shm``
segments, sockets, the distributed state) explicitly. What is left is Python's own full
collections at interpreter exit: ~2 s in each process on a 2-core CPU machine, the worker's first
and the engine core's after it, most of ``close()`` (docs/startup.md, "Closing"). ``gc.freeze``
at exit moves those objects out of the collector's reach; the operating system reclaims their
memory when the process ends. vLLM does the same itself on ROCm (``run_engine_core``: "Freeze the
surviving graph to skip another slow cyclic-GC scan during finalization; process exit reclaims
it"). Every ``atexit`` handler still runs, exit codes and output flushing are Python's own, and
vLLM's explicit teardown has already run (the close test checks that the engine's processes
unlink their own shared memory, before the supervisor would). Objects that become garbage only at
exit are not finalised (``__del__`` of objects in reference cycles), which Python never
guarantees at exit either.

Never outlive the caller (engine core). vLLM's engine core does not notice its parent dying: a
caller killed by a signal that Python does not handle (SIGTERM, SIGKILL) or ended by
``os._exit`` leaves the engine core and its worker running, holding the model's memory and the
CPU, serving nobody. A daemon thread blocks on the parent's pidfd (Linux; elsewhere it checks
the parent pid every second) and, when the parent is gone, sends this process SIGTERM: vLLM's
own handler then shuts the engine down as ``close()`` would (its worker stops with it, and the
queues' shared memory is unlinked by the processes that created it).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import multiprocessing
import os
import select
import signal
import threading
import time

from guardrail.protocol import ENGINE_ENV, FAST_EXIT_ENV

__all__ = ["armed", "is_engine_process", "register"]

_registered = False
_fast_exit = False

# The names vLLM gives the processes it spawns (vllm/v1/engine/utils.py: "EngineCore",
# "EngineCore_DP<i>"; vllm/v1/executor/multiproc_executor.py: "VllmWorker-<rank>").
_ENGINE_CORE_PREFIX = "EngineCore"
_WORKER_PREFIX = "VllmWorker-"
PARENT_POLL_S = 1.0
"""Where no pidfd is available: how often the engine core checks that its parent lives."""


def is_engine_process(name: str | None = None) -> bool:
    """True in a process vLLM spawned for an engine (its engine core or a worker); ``name``
    defaults to this process's ``multiprocessing`` name."""
    name = multiprocessing.current_process().name if name is None else name
    return name.startswith((_ENGINE_CORE_PREFIX, _WORKER_PREFIX))


def register() -> None:
    """vLLM's plugin entry point (see the module docstring). Idempotent: vLLM may load plugins
    more than once per process."""
    global _registered, _fast_exit
    if _registered or os.environ.get(ENGINE_ENV) != "1" or not is_engine_process():
        return
    _registered = True
    if os.environ.get(FAST_EXIT_ENV) != "0":
        _fast_exit = True
        atexit.register(gc.freeze)
    if multiprocessing.current_process().name.startswith(_ENGINE_CORE_PREFIX):
        parent = os.getppid()
        threading.Thread(
            target=_stop_when_parent_exits,
            args=(parent,),
            name="guardrail-parent-watch",
            daemon=True,
        ).start()


def armed() -> bool:
    """Whether this process will freeze its heap at exit (``register`` took effect here)."""
    return _fast_exit


def _stop_when_parent_exits(parent: int) -> None:
    """Block until process ``parent`` has exited, then SIGTERM this process."""
    pidfd = None
    with contextlib.suppress(OSError, AttributeError):  # no pidfd: old kernel, not Linux
        pidfd = os.pidfd_open(parent)
    if pidfd is not None and os.getppid() == parent:  # still ours once the fd is open
        waiter = select.poll()  # (poll: no FD_SETSIZE limit on the fd number, unlike select)
        waiter.register(pidfd, select.POLLIN)
        while not waiter.poll():  # readable when the parent exits
            pass
    else:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
