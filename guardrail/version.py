"""The installed distribution's version, as ``guardrail.__version__`` and ``--version`` say."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__ = version("vllm-guardrail")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
