"""Adapters to application frameworks, installed as ``guardrail.integrations``.

Each adapter is its own module and imports its framework only when imported itself, so this
package (and the core ``guardrail`` package, which never imports it) works without them:

- ``guardrail.integrations.langchain``: LangChain chat model, guarded runnables, input guard
  (needs ``pip install 'vllm-guardrail[langchain]'``);
- ``guardrail.integrations.fakes``: engine-free fakes of those adapters for your own tests.
"""
