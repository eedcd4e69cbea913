"""A vLLM general plugin: a guarded engine's processes exit without collecting their heap.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes (the engine core
in ``EngineCore.__init__``, each worker in ``WorkerWrapperBase.init_worker``; pyproject.toml
registers ``register`` below). In the processes of an engine started by this library (the
caller sets ``FAST_EXIT_ENV`` while vLLM spawns them: ``guardrail.engine.vllm_client``) it
registers ``gc.freeze`` to run at interpreter exit.

Why. vLLM's shutdown (``EngineCore.shutdown``, ``Worker.shutdown``) calls ``gc.unfreeze()``,
handing the whole start-up heap (~700,000 objects: torch, vLLM, the model) back to the
collector, and tears down everything that holds an outside resource (message queues and their
``/dev/shm`` segments, sockets, the distributed state) explicitly. What is left is Python's own
full collections at interpreter exit: ~2 s in each process on a 2-core CPU machine, the worker's
first and the engine core's after it, which is most of ``close()`` (docs/startup.md, "Closing").
Freezing the heap once the process is exiting moves those objects out of the collector's reach;
the operating system reclaims their memory when the process ends. vLLM does the same itself on
ROCm (``run_engine_core``: "Freeze the surviving graph to skip another slow cyclic-GC scan
during finalization; process exit reclaims it"); this extends it to the engines this library
starts, on every device.

What it does not change: every ``atexit`` handler still runs, exit codes and output flushing are
Python's own, and vLLM's explicit teardown has already run (the close test checks that the
engine's processes unlink their own shared memory, before the supervisor would). Objects that
become garbage only at exit are not finalised (``__del__`` of objects in reference cycles), which
Python never guarantees at exit either. Other vLLM engines in the same environment are untouched:
the plugin acts only with ``FAST_EXIT_ENV=1``, and only in vLLM's engine-core and worker
processes, never in the caller's. ``FAST_EXIT_ENV=0`` in the environment turns it off.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os

from guardrail.protocol import FAST_EXIT_ENV

__all__ = ["armed", "is_engine_process", "register"]

_registered = False

# The names vLLM gives the processes it spawns (vllm/v1/engine/utils.py: "EngineCore",
# "EngineCore_DP<i>"; vllm/v1/executor/multiproc_executor.py: "VllmWorker-<rank>").
_ENGINE_PROCESS_PREFIXES = ("EngineCore", "VllmWorker-")


def is_engine_process(name: str | None = None) -> bool:
    """True in a process vLLM spawned for an engine (its engine core or a worker); ``name``
    defaults to this process's ``multiprocessing`` name."""
    name = multiprocessing.current_process().name if name is None else name
    return name.startswith(_ENGINE_PROCESS_PREFIXES)


def register() -> None:
    """vLLM's plugin entry point: arm ``gc.freeze`` at exit in a guarded engine's process.
    Idempotent; does nothing elsewhere (see the module docstring)."""
    global _registered
    if _registered or os.environ.get(FAST_EXIT_ENV) != "1" or not is_engine_process():
        return
    _registered = True
    atexit.register(gc.freeze)


def armed() -> bool:
    """Whether this process will freeze its heap at exit (``register`` took effect here)."""
    return _registered
