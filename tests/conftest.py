"""Shared fixtures: tiny models are built once per machine, engines once per test session.

Engines start in vLLM's in-process mode (fast, one process) unless a test asks for the
multi-process engine. Environment for vLLM's CPU backend is set here, for tests only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_ENGINE_ARGS = {
    "dtype": "float32",
    "enforce_eager": True,
    "block_size": 32,
    "max_num_batched_tokens": 128,  # forces chunked prefill on longer prompts
    "max_model_len": 2048,
    "seed": 0,
}


def _cache_root() -> Path:
    root = os.environ.get("GUARDRAIL_TEST_CACHE") or os.path.expanduser(
        "~/.cache/vllm-guardrail/tests"
    )
    return Path(root)


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    from guardrail.testing.tiny_models import build_tiny_model

    return build_tiny_model(_cache_root() / "tiny-llama", arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir() -> Path:
    from guardrail.testing.tiny_models import build_tiny_model

    return build_tiny_model(_cache_root() / "tiny-qwen2", arch="qwen2")


def tiny_config(model_id: str = "tiny", threshold: float | None = 0.5):  # type: ignore[no-untyped-def]
    """A probe config over every head of the tiny models (4 layers x 4 heads)."""
    from guardrail.probe.config import ModelProbeConfig

    heads = [(layer, head) for layer in range(4) for head in range(4)]
    return ModelProbeConfig(model_id=model_id, heads=heads, threshold=threshold)


def start_engine(model_dir: Path, multiprocess: bool = True, **overrides):  # type: ignore[no-untyped-def]
    import vllm.envs

    from guardrail.engine import HookedLLM

    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    # vLLM caches its environment after the first engine starts; tests switch modes per engine.
    if vllm.envs._is_envs_cache_enabled():
        vllm.envs.__getattr__.cache_clear()
    try:
        args = {**TINY_ENGINE_ARGS, **overrides}
        config = args.pop("probe_config", tiny_config())
        return HookedLLM(str(model_dir), config, **args)
    finally:
        if previous is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama_dir: Path) -> Iterator[object]:
    """The one hooked engine most tests share: tiny Llama, in-process, every head probed.

    Only this engine runs in-process: closing an in-process vLLM engine tears down the
    process-wide distributed state, which would break any other in-process engine.
    """
    engine = start_engine(tiny_llama_dir, multiprocess=False)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def tiny_qwen2_engine(tiny_qwen2_dir: Path) -> Iterator[object]:
    engine = start_engine(tiny_qwen2_dir, multiprocess=True)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from guardrail.embedded import embedded_model_path

    return embedded_model_path()
