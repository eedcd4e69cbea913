"""Shared fixtures: tiny models are built once per machine, engines once per test session.

Engines start in vLLM's in-process mode (fast, one process) unless a test asks for the
multi-process engine. Environment for vLLM's CPU backend is set here, for tests only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import start_engine, tiny_hidden_config

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
def tiny_hidden_engine(tiny_llama_dir: Path) -> Iterator[object]:
    """Tiny Llama with the hidden-state signal: a config reading layers 1-3 (last token and
    data mean), and the whole stream of layers 0-2 at the last token and averaged over the data
    tokens returned with every result (as calibration reads it)."""
    engine = start_engine(
        tiny_llama_dir,
        multiprocess=True,
        probe_config=tiny_hidden_config(),
        probe_hidden_layers=[0, 1, 2],
        probe_data_mean_layers=[0, 1, 2],
        num_gpu_blocks_override=1024,  # the whole-stream memo holds 128 floats per KV slot
    )
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from guardrail.embedded import embedded_model_path

    return embedded_model_path()
