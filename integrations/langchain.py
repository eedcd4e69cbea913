"""LangChain adapters (langchain-core >= 1.8): guard existing chains without rewriting them.

- ``GuardedChatModel``: a chat model backed by a ``GuardedLLM``; the probe runs inside the
  serving model, the verdict travels in ``response_metadata["guardrail"]``, a block raises
  ``GuardrailBlockedError`` (a ``LangChainException``, so ``with_fallbacks`` can catch it).
- ``AsyncGuardedChatModel``: the same on the ``AsyncGuardedLLM`` (vLLM's ``AsyncLLM``), streaming
  tokens as they are generated, the verdict on the first chunk.
- ``GuardedRunnable`` (or ``guard_chain``): wrap any runnable; name the untrusted inputs, and its
  guarded model calls treat exactly those spans as data; the policy acts on the whole chain.
- ``InputGuard``: for a remote model, score (instruction, untrusted data) locally first.
- ``VerdictCollector``: a callback handler collecting each guarded chain's ``ChainVerdict``.
- ``guardrail.integrations.fakes.FakeGuardedChatModel``: the same behaviour without an engine,
  for your tests.

Install with ``pip install 'vllm-guardrail[langchain]'``. See docs/langchain.md.

Example:
    >>> from guardrail.integrations.langchain import GuardedChatModel, GuardedRunnable
    >>> model = GuardedChatModel(guarded=guarded_llm)  # doctest: +SKIP
    >>> chain = GuardedRunnable(runnable=prompt | model | StrOutputParser(),  # doctest: +SKIP
    ...                         untrusted=["context"], on_block="refuse")
    >>> chain.invoke({"context": docs_text, "question": "When?"})  # doctest: +SKIP
"""

from __future__ import annotations

try:
    import langchain_core  # noqa: F401
except ImportError as exc:  # pragma: no cover - tests/unit/test_core_without_langchain.py
    raise ImportError(
        "guardrail.integrations.langchain needs langchain-core: "
        "pip install 'vllm-guardrail[langchain]'"
    ) from exc

from ._lc_async_chat_model import AsyncGuardedChatModel
from ._lc_chat_model import METADATA_KEY, GuardedChatModel, GuardedChatModelBase
from ._lc_input_guard import InputGuard, guard_chain
from ._lc_marking import mark_untrusted, to_guardrail_messages
from ._lc_runnable import CHAIN_METADATA_KEY, GuardedRunnable
from ._lc_scope import VERDICT_EVENT, ChainVerdict, GuardrailBlockedError, VerdictCollector

__all__ = [
    "CHAIN_METADATA_KEY",
    "METADATA_KEY",
    "VERDICT_EVENT",
    "AsyncGuardedChatModel",
    "ChainVerdict",
    "GuardedChatModel",
    "GuardedChatModelBase",
    "GuardedRunnable",
    "GuardrailBlockedError",
    "InputGuard",
    "VerdictCollector",
    "guard_chain",
    "mark_untrusted",
    "to_guardrail_messages",
]
