"""Shared fixtures: tiny models are built once per machine, engines once per test session.

The guarded OpenAI-compatible server (``served``) is one per session too: tests/engine/
test_serving.py and test_serving_tools.py share it (a tiny Llama whose template renders tools,
tool calling on), so its engine starts once.

Engines start in vLLM's in-process mode (fast, one process) unless a test asks for the
multi-process engine. Environment for vLLM's CPU backend is set here, for tests only.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    SERVED_CHATS,
    SERVED_MAX_MODEL_LEN,
    SERVED_MAX_TOKENS,
    start_async_engine,
    start_engine,
    tiny_hidden_config,
    uvicorn_in_thread,
)

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


# -- the shared guarded server -------------------------------------------------------------------


@pytest.fixture(scope="session")
def served_offline(tiny_engine: Any) -> list[Any]:
    """The offline engine's greedy outputs for ``SERVED_CHATS``: the server's references."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=SERVED_MAX_TOKENS)
    return tiny_engine.generate(SERVED_CHATS, params)


@pytest.fixture(scope="session")
def low_and_threshold(served_offline: list[Any]) -> tuple[int, float]:
    """The lowest-scoring chat of ``SERVED_CHATS`` and a threshold between it and the next."""
    focus = [o.probe.focus for o in served_offline]
    ordered = sorted(focus)
    assert min(b - a for a, b in itertools.pairwise(ordered)) > 1e-3, focus
    return focus.index(ordered[0]), (ordered[0] + ordered[1]) / 2


@pytest.fixture(scope="session")
def served_model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with ``SERVED_TEMPLATE``: tools rendered Hermes-style, any request without
    tools rendered exactly as the tiny Llama's own template renders it."""
    from tests.tool_templates import SERVED_TEMPLATE

    model = tmp_path_factory.mktemp("tiny-llama-served")
    shutil.copytree(tiny_llama_dir, model, dirs_exist_ok=True)
    (model / "chat_template.jinja").write_text(SERVED_TEMPLATE)
    return model


@pytest.fixture(scope="session")
def served(
    served_model_dir: Path, low_and_threshold: tuple[int, float]
) -> Iterator[tuple[str, Any]]:
    """The guarded server's base URL and its app (``app.state.guard`` is the running guard),
    as ``guardrail-serve --enable-auto-tool-choice --tool-call-parser hermes`` builds it.

    It blocks at a threshold between two of ``SERVED_CHATS``' offline scores; a request may
    pick ``x-guardrail-policies: flag_only`` (flag at that threshold, never block) or
    ``block_all``; ``<doc>...</doc>`` in a message is data."""
    from guardrail.integrations._openai_tools import ToolCalling
    from guardrail.integrations._server_marking import DelimitedData
    from guardrail.integrations.serving import build_app
    from prometheus_client import CollectorRegistry

    from guardrail.guard.async_guarded import AsyncGuardedLLM
    from guardrail.metrics.recorder import GuardrailMetrics
    from guardrail.policy import load_policies

    _, threshold = low_and_threshold
    registry = CollectorRegistry()

    async def start() -> AsyncGuardedLLM:
        engine = await start_async_engine(  # vLLM's own metrics on, as guardrail-serve has them
            served_model_dir,
            max_model_len=SERVED_MAX_MODEL_LEN,
            disable_log_stats=False,
            served_model_name="tiny",
        )
        return AsyncGuardedLLM(
            engine,
            [{"threshold": threshold}],
            metrics=GuardrailMetrics(registry),
            model_name="tiny",
            owns_engine=True,
        )

    flag_only = [{"name": "flag_only", "threshold": threshold, "action": "flag"}]
    app = build_app(
        start,
        registry=registry,
        default_max_tokens=SERVED_MAX_TOKENS,
        policy_sets={
            "flag_only": load_policies(flag_only, None),
            "block_all": load_policies([{"threshold": 1.0}], None),
        },
        data_marking=DelimitedData("<doc>", "</doc>"),
        tool_calling=ToolCalling(enable_auto_tool_choice=True, tool_call_parser="hermes"),
    )
    with uvicorn_in_thread(app, start_timeout=600) as base:  # the engine starts in lifespan
        yield base, app
