"""Engine arguments that start fast on CPU, for what the user leaves unset.

``HookedLLM`` passes its engine arguments through ``cpu_defaults`` when vLLM runs on the CPU
(``guardrail.engine.engine_process`` asks vLLM's platform); on any other device they go to vLLM
unchanged. An argument the user gave always wins, whatever its value.

- ``dtype="float32"`` unless ``dtype`` is given: vLLM's ``auto`` would run a float32 checkpoint
  in bfloat16, and the shipped probe configs were calibrated in float32 (on a GPU ``auto``
  stays: the model's own dtype, which FlashAttention needs).
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

``cpu_environment`` sets ``VLLM_HOST_IP=127.0.0.1`` when it is unset (vLLM's engine queues bind
to the host's address, which a sandboxed CPU machine may not resolve); never on other devices,
where it would break multi-node serving.

Example:
    >>> cpu_defaults({}, environ={})
    {'dtype': 'float32', 'enforce_eager': True, 'kv_cache_memory_bytes': 1073741824}
    >>> cpu_defaults({"dtype": "bfloat16", "enforce_eager": 0}, environ={KV_CACHE_VARIABLE: "2"})
    {'dtype': 'bfloat16', 'enforce_eager': 0}
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = [
    "COMPILE_ARGUMENTS",
    "CPU_ENVIRONMENT",
    "CPU_KV_CACHE_BYTES",
    "KV_CACHE_ARGUMENTS",
    "cpu_defaults",
    "cpu_environment",
]

CPU_KV_CACHE_BYTES = 1 << 30
"""The CPU KV cache when the user sets no size: 1 GiB."""

COMPILE_ARGUMENTS = ("enforce_eager", "compilation_config", "optimization_level")
"""Engine arguments that choose between eager and compiled mode: any of them turns the eager
default off."""

KV_CACHE_ARGUMENTS = ("kv_cache_memory_bytes", "gpu_memory_utilization")
"""Engine arguments that size the KV cache: any of them turns the size default off."""

KV_CACHE_VARIABLE = "VLLM_CPU_KVCACHE_SPACE"

CPU_ENVIRONMENT = {"VLLM_HOST_IP": "127.0.0.1"}
"""Environment variables set on the CPU when unset (see the module docstring)."""


def cpu_defaults(
    engine_kwargs: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``engine_kwargs`` plus the CPU start-up defaults for what they leave unset (see the
    module docstring). ``environ`` defaults to ``os.environ``; nothing is written to it."""
    env = os.environ if environ is None else environ
    arguments = dict(engine_kwargs)
    arguments.setdefault("dtype", "float32")
    if not any(name in arguments for name in COMPILE_ARGUMENTS):
        arguments["enforce_eager"] = True
    if not any(name in arguments for name in KV_CACHE_ARGUMENTS) and not env.get(KV_CACHE_VARIABLE):
        arguments["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    return arguments


def cpu_environment(environ: MutableMapping[str, str] | None = None) -> None:
    """Set ``CPU_ENVIRONMENT``'s variables that ``environ`` (default ``os.environ``) lacks."""
    env = os.environ if environ is None else environ
    for name, value in CPU_ENVIRONMENT.items():
        env.setdefault(name, value)
