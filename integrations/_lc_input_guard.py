"""Input-guard mode, for chains whose model is remote (e.g. an OpenAI-compatible endpoint): the
local hooked engine scores the (instruction, untrusted data) pair before the chain goes on.

``InputGuard`` is a pass-through step: it scores its input (rendered through ``prompt`` when
given, so the probe reads what the remote model will read) with ``GuardedLLM.score`` (prefill and
one token), raises ``GuardrailBlockedError`` on block, and otherwise returns the input unchanged.
Inside a ``GuardedRunnable`` its verdict joins the chain verdict; standalone, it dispatches its
own ``"guardrail_verdict"`` event.

Example:
    >>> check = InputGuard(guarded=local, untrusted=["context"], prompt=prompt)  # doctest: +SKIP
    >>> chain = GuardedRunnable(runnable=check | prompt | remote_model | StrOutputParser(),
    ...                         untrusted=["context"], on_block="refuse")  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import adispatch_custom_event, dispatch_custom_event
from langchain_core.documents import Document
from langchain_core.prompts import BasePromptTemplate
from langchain_core.runnables import Runnable, RunnableConfig, RunnableSerializable
from pydantic import ConfigDict, Field, field_validator

from guardrail.errors import ConfigError, RequestError
from guardrail.guard.batcher import batcher_for
from guardrail.guard.guarded import GuardedLLM, GuardedResult
from guardrail.policy import Policy
from guardrail.policy.verdict import Verdict
from guardrail.probe.prompts import GuardedPrompt, RequestLike

from ._lc_marking import to_guardrail_messages, untrusted_strings
from ._lc_runnable import GuardedRunnable, validate_keys, validate_policies
from ._lc_scope import (
    VERDICT_EVENT,
    ChainVerdict,
    GuardrailBlockedError,
    GuardScope,
    scope_policies,
    scopes_of,
)


def _as_text(value: Any) -> str:
    if isinstance(value, Document):
        return value.page_content
    if isinstance(value, list | tuple):
        return "\n\n".join(_as_text(v) for v in value)
    return value if isinstance(value, str) else str(value)


class InputGuard(RunnableSerializable[dict[str, Any], dict[str, Any]]):
    """Score a dict input's (trusted instruction, untrusted data) with the local engine; pass
    the input through unless a policy blocks it.

    With ``prompt``, the input is rendered through it and the untrusted values inside the
    messages are marked as data. Without, the trusted string inputs (joined by newlines) are the
    instruction and the ``untrusted`` inputs the data. ``policies`` defaults to the enclosing
    guard's, then to the ``GuardedLLM``'s.

    Example:
        >>> InputGuard(guarded=local, untrusted=["context"]).invoke(  # doctest: +SKIP
        ...     {"question": "When?", "context": "Opens at 9."})
        {'question': 'When?', 'context': 'Opens at 9.'}
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    guarded: GuardedLLM = Field(exclude=True)
    untrusted: tuple[str, ...]
    prompt: BasePromptTemplate | None = None
    policies: tuple[Policy, ...] | None = None

    _check_policies = field_validator("policies", mode="before")(validate_policies)
    _check_keys = field_validator("untrusted", mode="before")(validate_keys)

    def get_input_schema(self, config: RunnableConfig | None = None) -> Any:
        """The prompt's input schema when there is a prompt (the input fills it), so a guard
        around ``InputGuard | ...`` can check its untrusted keys when it is built."""
        if self.prompt is not None:
            return self.prompt.get_input_schema(config)
        return super().get_input_schema(config)

    def _request(self, input: Any, scopes: Sequence[GuardScope]) -> RequestLike:
        if not isinstance(input, dict):
            raise ConfigError(f"InputGuard takes a dict input, got {type(input).__name__}")
        if self.prompt is not None:
            values = [v for k in self.untrusted if k in input for v in untrusted_strings(input[k])]
            values += [v for scope in scopes for v in scope.untrusted_values()]
            messages, found = to_guardrail_messages(
                self.prompt.format_prompt(**input).to_messages(), values
            )
            for scope in scopes:
                scope.note_marked(found)
            return messages
        trusted = [v for k, v in input.items() if k not in self.untrusted and isinstance(v, str)]
        instruction = "\n".join(t for t in trusted if t.strip())
        if not instruction:
            raise RequestError(
                "the input has no trusted text to score the data against: pass prompt= (the "
                "chain's prompt template), or include the user's request in the input"
            )
        data = "\n\n".join(_as_text(input[k]) for k in self.untrusted if k in input)
        return GuardedPrompt(instruction=instruction, data=data)

    def _submit(self, input: Any, run_manager: Any) -> tuple[Any, list[GuardScope]]:
        scopes = scopes_of(run_manager)
        request = self._request(input, scopes)
        policies = self.policies if self.policies is not None else scope_policies(scopes)
        future = batcher_for(self.guarded).submit(
            self.guarded, request, policies=policies, scoring=True
        )
        return future, scopes

    @staticmethod
    def _settle(result: GuardedResult, scopes: Sequence[GuardScope]) -> Verdict:
        if result.error is not None:
            raise result.error
        if result.verdict is None:
            raise RequestError("the guarded engine returned no verdict for this input")
        for scope in scopes:
            scope.record(result.verdict)
        if result.verdict.blocked:
            raise GuardrailBlockedError(
                f"input blocked before the chain ran: {result.verdict.reason}", result.verdict
            )
        return result.verdict

    def _check(self, input: Any, run_manager: Any, config: RunnableConfig, **_: Any) -> Any:
        future, scopes = self._submit(input, run_manager)
        verdict = self._settle(future.result(), scopes)
        if not scopes:
            report = ChainVerdict.from_verdicts([verdict]).model_dump(mode="json")
            dispatch_custom_event(VERDICT_EVENT, report, config=config)
        return input

    async def _acheck(self, input: Any, run_manager: Any, config: RunnableConfig, **_: Any) -> Any:
        future, scopes = self._submit(input, run_manager)
        verdict = self._settle(await asyncio.wrap_future(future), scopes)
        if not scopes:
            report = ChainVerdict.from_verdicts([verdict]).model_dump(mode="json")
            await adispatch_custom_event(VERDICT_EVENT, report, config=config)
        return input

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return self._call_with_config(self._check, input, config, **kwargs)

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return await self._acall_with_config(self._acheck, input, config, **kwargs)


def guard_chain(
    runnable: Runnable[Any, Any],
    *,
    untrusted: Sequence[str] = (),
    input_guard: GuardedLLM | None = None,
    prompt: BasePromptTemplate[Any] | None = None,
    **options: Any,
) -> GuardedRunnable:
    """Guard a chain in one call. With ``input_guard`` (a local ``GuardedLLM``), the chain's
    input is scored first by an ``InputGuard`` (for chains whose model is remote); ``prompt`` is
    the chain's prompt template, so the probe reads what the model will read. ``options`` go to
    ``GuardedRunnable`` (``policies``, ``on_block``, ``refusal``, ``include_report``, ...).

    Example:
        >>> guarded = guard_chain(prompt | remote | StrOutputParser(), untrusted=["context"],
        ...                       input_guard=local, prompt=prompt)  # doctest: +SKIP
    """
    keys = validate_keys(untrusted)
    if input_guard is not None:
        check = InputGuard(guarded=input_guard, untrusted=keys, prompt=prompt)
        runnable = check | runnable
    elif prompt is not None:
        raise ConfigError("prompt= is used by the input guard: pass input_guard= too")
    return GuardedRunnable(runnable=runnable, untrusted=keys, **options)
