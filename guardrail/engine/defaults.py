"""Engine arguments that start fast on CPU, for what the user leaves unset.

``HookedLLM`` passes its engine arguments through ``cpu_defaults`` when vLLM runs on the CPU
(``guardrail.engine.vllm_client`` asks vLLM's platform); on any other device they go to vLLM
unchanged. An argument the user gave always wins, whatever its value.

- ``enforce_eager=True`` unless ``enforce_eager``, ``compilation_config`` or
  ``optimization_level`` is given. vLLM's default compiled mode compiles the model with
  torch.compile/Inductor (C++ kernels built by the system compiler) at every start: minutes on a
  2-core machine, against seconds eager; docs/startup.md has the figures and what compiled mode
  buys back (decode throughput). The probe works in both modes.
- ``kv_cache_memory_bytes`` (``CPU_KV_CACHE_BYTES``, 1 GiB) unless ``kv_cache_memory_bytes`` or
  ``gpu_memory_utilization`` is given or ``VLLM_CPU_KVCACHE_SPACE`` is set (vLLM's own variable
  for it, which overrides the argument). Without any of them vLLM's CPU backend asks for 92 % of
  the machine's memory and fails to start when anything else uses more than 8 % of it. An
  explicit size, in eager mode, also skips vLLM's warm-up forward pass. 1 GiB holds ~23,000
  tokens of the embedded SmolLM2-135M in float32 (about three 8,192-token requests); a larger
  model or longer context needs a larger value, and vLLM says so at start.

Example:
    >>> cpu_defaults({"dtype": "float32"}, environ={})
    {'dtype': 'float32', 'enforce_eager': True, 'kv_cache_memory_bytes': 1073741824}
    >>> cpu_defaults({"enforce_eager": False}, environ={"VLLM_CPU_KVCACHE_SPACE": "2"})
    {'enforce_eager': False}
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["COMPILE_ARGUMENTS", "CPU_KV_CACHE_BYTES", "KV_CACHE_ARGUMENTS", "cpu_defaults"]

CPU_KV_CACHE_BYTES = 1 << 30
"""The CPU KV cache when the user sets no size: 1 GiB."""

COMPILE_ARGUMENTS = ("enforce_eager", "compilation_config", "optimization_level")
"""Engine arguments that choose between eager and compiled mode: any of them turns the eager
default off."""

KV_CACHE_ARGUMENTS = ("kv_cache_memory_bytes", "gpu_memory_utilization")
"""Engine arguments that size the KV cache: any of them turns the size default off."""

KV_CACHE_VARIABLE = "VLLM_CPU_KVCACHE_SPACE"


def cpu_defaults(
    engine_kwargs: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``engine_kwargs`` plus the CPU start-up defaults for what they leave unset (see the
    module docstring). ``environ`` defaults to ``os.environ``; nothing is written to it."""
    env = os.environ if environ is None else environ
    arguments = dict(engine_kwargs)
    if not any(name in arguments for name in COMPILE_ARGUMENTS):
        arguments["enforce_eager"] = True
    if not any(name in arguments for name in KV_CACHE_ARGUMENTS) and not env.get(KV_CACHE_VARIABLE):
        arguments["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    return arguments
