"""The hidden-state signal on a compiled ``AsyncHookedLLM`` (vLLM's ``AsyncLLM``, the engine of
``guardrail-serve``), CPU: it starts with the tapping worker too, and its terms equal Hugging
Face's. Its own compiled engine (slow: see test_compiled_hidden.py for the times)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.engine.test_async_engine import REQUESTS, _cancel_the_rest
from tests.engine.test_hidden_state import expected_terms, hf_streams
from tests.helpers import start_async_engine, tiny_hidden_config

pytestmark = pytest.mark.slow


def test_a_compiled_async_engine_reads_the_hidden_terms_hf_gives(tiny_llama_dir: Path) -> None:
    from vllm import SamplingParams

    async def generate() -> tuple[dict[str, Any], list[Any]]:
        engine = await start_async_engine(
            tiny_llama_dir, enforce_eager=False, probe_config=tiny_hidden_config()
        )
        try:
            params = SamplingParams(temperature=0.0, max_tokens=1)
            return dict(engine.model_info), await engine.generate(REQUESTS, params)
        finally:
            engine.close()

    loop = asyncio.new_event_loop()
    try:
        info, outputs = loop.run_until_complete(asyncio.wait_for(generate(), timeout=500))
        loop.run_until_complete(_cancel_the_rest())  # vLLM's output tasks, after its shutdown
    finally:
        loop.close()
    assert info["enforce_eager"] is False and info["hidden_layers"] == [1, 2, 3]
    config = tiny_hidden_config()
    for out in outputs:
        assert out.error is None and out.probe is not None and out.probe.error is None
        p = out.prompt
        spans = tuple(tuple(s) for s in p.data_spans)
        want = expected_terms(config, *hf_streams(str(tiny_llama_dir), tuple(p.token_ids), spans))
        assert out.probe.hidden == pytest.approx(want, abs=5e-6)
