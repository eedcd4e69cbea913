"""Console applications (the ``guardrail`` CLI, the examples, the demo): show the library's own
output, keep vLLM's start-up and shutdown logs behind ``--verbose``.

Nothing here runs on import: an application calls ``quiet_engine_logs`` once, before it starts
an engine. vLLM reads its log level from the environment when it is first imported, and its
engine processes inherit the environment, so this sets ``VLLM_LOGGING_LEVEL`` (unless the user
set it) and filters the deprecation noise torch and vLLM print on CPU.

Example:
    >>> quiet_engine_logs(verbose=True)  # leaves everything as it is
"""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["quiet_engine_logs", "status"]


def quiet_engine_logs(verbose: bool = False) -> None:
    """Quiet vLLM, torch and transformers unless ``verbose``; call before starting an engine."""
    if verbose:
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # torch's C++ warnings (engine processes)
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")  # inherited by the engine
    for noisy in ("vllm", "torch", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(vllm|torch|transformers)")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(vllm|torch)")


def status(message: str) -> None:
    """One progress line on stderr (kept apart from the results on stdout)."""
    import sys

    print(f"... {message}", file=sys.stderr, flush=True)
