"""The old name of ``guardrail.engine.engine_process`` (the vLLM engine's process supervisor,
which is no client): every public name, re-exported unchanged, so old imports keep working.

Example:
    >>> from guardrail.engine import engine_process, vllm_client
    >>> vllm_client.EngineHandle is engine_process.EngineHandle
    True
"""

from guardrail.engine.engine_process import (
    EXIT_CODE_WAIT_S,
    PROCESS_EXIT_TIMEOUT_S,
    SHM_DIR,
    SHUTDOWN_TIMEOUT_S,
    EngineHandle,
    EngineSupervisor,
    SerialLLM,
    abort_unfinished,
    is_engine_dead_error,
    shutdown_engine,
)

__all__ = [
    "EXIT_CODE_WAIT_S",
    "PROCESS_EXIT_TIMEOUT_S",
    "SHM_DIR",
    "SHUTDOWN_TIMEOUT_S",
    "EngineHandle",
    "EngineSupervisor",
    "SerialLLM",
    "abort_unfinished",
    "is_engine_dead_error",
    "shutdown_engine",
]
