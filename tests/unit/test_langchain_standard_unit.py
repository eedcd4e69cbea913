"""LangChain's standard unit tests (``langchain-tests``) for ``GuardedChatModel``, without vLLM.

The subject is the real ``GuardedChatModel``; its ``GuardedLLM`` wraps ``guardrail.testing``'s
``FakeEngine`` (the tiny model's real tokenizer, scripted scores), so construction, the standard
constructor arguments, tracing parameters and the refusal of tool calling are tested as shipped.
The unit suite never calls the engine. Features the model lacks are declared through the suite's
own properties (see docs/langchain.md); nothing is skipped or overridden by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from guardrail.integrations.langchain import GuardedChatModel
from langchain_tests.unit_tests import ChatModelUnitTests

from guardrail.guard.guarded import GuardedLLM
from guardrail.probe.config import ModelProbeConfig
from guardrail.testing import FakeEngine

CONFIG = ModelProbeConfig(model_id="tiny-llama", heads=[(0, 0)], threshold=0.5)


@pytest.fixture(scope="module")
def fake_guarded(tiny_llama_dir: Path) -> GuardedLLM:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    return GuardedLLM.from_engine(FakeEngine(CONFIG, tokenizer, focus=lambda prompt, n: 0.9))


class TestGuardedChatModelStandardUnit(ChatModelUnitTests):
    guarded: GuardedLLM

    @pytest.fixture(autouse=True)
    def _guarded(self, fake_guarded: GuardedLLM) -> None:
        self.guarded = fake_guarded

    @property
    def chat_model_class(self) -> type[GuardedChatModel]:
        return GuardedChatModel

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"guarded": self.guarded}

    # What the model lacks, declared through the suite's own properties.
    @property
    def has_tool_calling(self) -> bool:
        return False  # plain text generation; bind_tools raises NotImplementedError

    @property
    def has_tool_choice(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False  # with_structured_output needs tool calling

    @property
    def supports_model_override(self) -> bool:
        return False  # one engine serves one model; a per-call model= naming another is refused


def test_standard_arguments_have_their_meaning(fake_guarded: GuardedLLM) -> None:
    model = GuardedChatModel(
        guarded=fake_guarded,
        max_tokens=7,
        temperature=0.3,
        stop=["END"],
        timeout=2.5,
        max_retries=3,
        api_key="unused",
        streaming=True,
    )
    params = model._get_ls_params()
    assert params["ls_model_name"] == "tiny-llama" and params["ls_provider"] == "vllm"
    assert params["ls_max_tokens"] == 7 and params["ls_temperature"] == 0.3
    assert params["ls_stop"] == ["END"]
    assert model._get_ls_params(stop=["X"])["ls_stop"] == ["X"]  # a per-call stop replaces
    assert "unused" not in repr(model) and "api_key" not in model.model_dump()
    with pytest.raises(NotImplementedError, match="does not support tool calling"):
        model.bind_tools([])
    with pytest.raises(NotImplementedError, match="does not support tool calling"):
        model.with_structured_output({"title": "T", "type": "object", "properties": {}})
