"""LangChain's standard integration tests (``langchain-tests``) for ``GuardedChatModel`` on the
real engine: the shared tiny random Llama (``tiny_engine``), every call probed.

The random model writes gibberish; these tests check structure (message types, usage metadata,
stream chunks and their lifecycle, batching, stop strings), not content. The guard's policy
only flags (at the model's calibrated threshold), so the probe runs on every call and no call
is blocked. Features the model lacks are declared through the suite's own properties (see
docs/langchain.md); nothing is skipped or overridden by hand.
"""

from __future__ import annotations

from typing import Any

import pytest
from guardrail.integrations.langchain import GuardedChatModel
from langchain_tests.integration_tests import ChatModelIntegrationTests

from guardrail.guard.guarded import GuardedLLM

WATCH = [{"name": "watch", "action": "flag"}]  # probe every call, never block

# The suite mixes sync and async tests, and the project's pytest runs pytest-asyncio in strict
# mode: mark the class, and silence the warning the mark gives its sync tests.
SYNC_TEST_MARKED = "ignore:.*is marked with '@pytest.mark.asyncio':pytest.PytestWarning"
ASYNC = [pytest.mark.asyncio, pytest.mark.filterwarnings(SYNC_TEST_MARKED)]


@pytest.fixture(scope="module")
def watched(tiny_engine: Any) -> GuardedLLM:
    return GuardedLLM.from_engine(tiny_engine, WATCH)


class TestGuardedChatModelStandard(ChatModelIntegrationTests):
    pytestmark = ASYNC
    guarded: GuardedLLM

    @pytest.fixture(autouse=True)
    def _guarded(self, watched: GuardedLLM) -> None:
        self.guarded = watched

    @property
    def chat_model_class(self) -> type[GuardedChatModel]:
        return GuardedChatModel

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"guarded": self.guarded, "max_tokens": 8}

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
