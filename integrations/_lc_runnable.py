"""``GuardedRunnable``: wrap any runnable so its guarded model calls treat the named inputs as data
and the policy acts on the whole chain; ``InputGuard``: score a chain's (instruction, untrusted
data) with the local engine before a remote model sees it.

Example:
    >>> rag = {"context": retriever | join, "question": question} | answer  # doctest: +SKIP
    >>> guarded = GuardedRunnable(runnable=rag, untrusted=["context"])  # doctest: +SKIP
    >>> guarded.invoke("When does the museum open?")  # doctest: +SKIP
    'It opens at 9:00.'
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from functools import partial
from typing import Any, Literal

from langchain_core.callbacks import adispatch_custom_event, dispatch_custom_event
from langchain_core.messages import BaseMessage
from langchain_core.runnables import Runnable, RunnableConfig, RunnableSerializable
from langchain_core.runnables.config import ensure_config
from langchain_core.runnables.utils import AddableDict
from pydantic import BaseModel, ConfigDict, PrivateAttr, field_validator

from guardrail.errors import ConfigError, PromptInjectionBlocked
from guardrail.guard.guarded import DEFAULT_REFUSAL
from guardrail.policy import Policy, load_policy
from guardrail.policy.kinds import POLICY_TYPES

from ._lc_scope import VERDICT_EVENT, ChainVerdict, GuardrailBlockedError, GuardScope

CHAIN_METADATA_KEY = "guardrail_chain"
"""Key of the ``ChainVerdict`` in a guarded chain's message output ``response_metadata``."""

OnBlock = Literal["raise", "refuse"]

logger = logging.getLogger("guardrail.integrations.langchain")


def validate_policies(policies: Any) -> tuple[Policy, ...] | None:
    """A guard's policy override: None (each model's own policies) or a non-empty list with
    distinct names. Thresholds are resolved per model, against its calibrated threshold.

    Example:
        >>> [p.name for p in validate_policies([{"name": "a", "threshold": 0.4}])]
        ['a']
    """
    if policies is None:
        return None
    if isinstance(policies, (*POLICY_TYPES, Mapping, str)):
        raise ConfigError("policies must be a list of policies; wrap a single one in a list")
    loaded = tuple(load_policy(p) for p in policies)
    names = [p.name for p in loaded]
    if not loaded or len(set(names)) != len(names):
        raise ConfigError(f"policies must be a non-empty list with distinct names, got {names}")
    return loaded


def validate_keys(keys: Any) -> tuple[str, ...]:
    if isinstance(keys, str) or not all(isinstance(k, str) and k for k in keys):
        raise ConfigError(
            f"untrusted must be a list of input names, e.g. untrusted=['context'], got {keys!r}"
        )
    return tuple(keys)


def _schema_keys(schema: Any) -> set[str] | None:
    """The keys an input/output schema lists, or None when it lists none (any input, a string,
    or the ``root`` stand-in LangChain uses when a step takes anything)."""
    try:
        properties = schema.model_json_schema().get("properties") or {}
    except Exception:  # an arbitrary type without a JSON schema: keys unknown
        return None
    keys = {k for k in properties if isinstance(k, str)}
    return keys if keys and "root" not in keys else None


def chain_keys(runnable: Runnable[Any, Any]) -> tuple[set[str], set[str]] | None:
    """``(input keys, every key visible inside)`` of a chain, from its input schema and the
    schemas of every step of its graph (so a key a step produces, e.g. the ``"context"`` of a
    ``RunnableParallel`` or ``RunnablePassthrough.assign``, counts); None when the chain's input
    schema lists no keys, so which keys it receives is only known when it runs.

    Example:
        >>> from langchain_core.prompts import ChatPromptTemplate
        >>> prompt = ChatPromptTemplate.from_messages([("user", "{context} {question}")])
        >>> sorted(chain_keys(prompt)[0])
        ['context', 'question']
    """
    try:
        top = _schema_keys(runnable.get_input_schema())
        if top is None:
            return None
        inside = set(top)
        for node in runnable.get_graph().nodes.values():
            data = node.data
            schemas = (
                [data]
                if isinstance(data, type) and issubclass(data, BaseModel)
                else [data.get_input_schema(), data.get_output_schema()]
                if isinstance(data, Runnable)
                else []
            )
            for schema in schemas:
                inside |= _schema_keys(schema) or set()
    except Exception:  # a step whose schema or graph cannot be built: check when it runs
        return None
    return top, inside


def with_handler(config: RunnableConfig | None, handler: Any) -> RunnableConfig:
    """A copy of ``config`` whose callbacks also hold ``handler`` (inherited by child runs)."""
    config = ensure_config(config)  # copies the callbacks list or manager
    callbacks = config.get("callbacks")
    if callbacks is None:
        config["callbacks"] = [handler]
    elif isinstance(callbacks, list):
        config["callbacks"] = [*callbacks, handler]
    else:
        callbacks.add_handler(handler, inherit=True)
    return config


def _gather(chunks: Iterator[Any]) -> Any:
    final: Any = None
    for i, chunk in enumerate(chunks):
        try:
            final = chunk if i == 0 else final + chunk
        except TypeError:
            final = chunk
    return final


async def _agather(chunks: AsyncIterator[Any]) -> Any:
    return _gather(iter([c async for c in chunks]))


class GuardedRunnable(RunnableSerializable[Any, Any]):
    """Any runnable, guarded: its guarded model calls mark the ``untrusted`` inputs as data,
    every verdict is collected, and the policy acts on the chain as a whole.

    ``untrusted`` names inputs whose values are untrusted data wherever they flow: the guard's
    own input keys and the same keys in the input or output of any runnable inside (e.g. the
    "context" a retriever step produces). ``untrusted_documents`` / ``untrusted_tool_outputs``
    also mark every retrieved document and tool output. ``policies`` (optional) overrides the
    models' policies for calls inside this guard.

    ``untrusted`` keys are checked: when the chain's input schema lists its keys, a key that
    neither the input nor any step of the chain has (a typo) raises ``ConfigError`` here;
    otherwise the first call logs a warning for a key that appeared nowhere.

    Outcome (``ChainVerdict`` over the verdicts of all guarded calls inside):
    - a block reaches the guard: with ``on_block="raise"`` (default) a
      ``GuardrailBlockedError`` carrying every verdict; with ``"refuse"`` the ``refusal`` (a
      value, or a callable of the ``ChainVerdict``). The chain verdict is ``block``.
    - the chain answers: its output; a message output gets the report in
      ``response_metadata["guardrail_chain"]``; with ``include_report=True`` every output is
      ``{"output": ..., "guardrail": ChainVerdict}``. The chain verdict is ``allow`` or
      ``flag``; a block the chain handled itself (``with_fallbacks``) gives ``flag`` with
      ``fell_back=True``, since the output delivered is the fallback's. Every call also
      dispatches the report as the custom callback event ``"guardrail_verdict"`` (see
      ``VerdictCollector``).

    Streaming passes chunks through as they come: a guarded model decides after its prefill,
    before its first chunk. A block after chunks were already emitted (e.g. a second model in a
    parallel branch) always raises, since emitted chunks cannot be taken back.
    ``retry_with_steering`` policies run as in ``GuardedLLM`` (the model's engine must be started
    with ``enforce_eager=True``; otherwise that call fails with a clear error, never unsteered).

    Example:
        >>> chain = prompt | GuardedChatModel(guarded=llm) | StrOutputParser()  # doctest: +SKIP
        >>> guarded = GuardedRunnable(runnable=chain, untrusted=["context"])  # doctest: +SKIP
        >>> guarded.invoke({"context": doc, "question": q})  # doctest: +SKIP
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    runnable: Runnable[Any, Any]
    untrusted: tuple[str, ...] = ()
    untrusted_documents: bool = False
    untrusted_tool_outputs: bool = False
    policies: tuple[Policy, ...] | None = None
    on_block: OnBlock = "raise"
    refusal: Any = DEFAULT_REFUSAL
    include_report: bool = False

    _check_policies = field_validator("policies", mode="before")(validate_policies)
    _check_keys = field_validator("untrusted", mode="before")(validate_keys)
    _check_on_first_call: bool = PrivateAttr(default=False)

    def __init__(self, **data: Any) -> None:
        super().__init__(**data)
        self._check_untrusted_keys()

    def _check_untrusted_keys(self) -> None:
        """Refuse an untrusted key the chain can never receive (a typo guards nothing). When
        the chain's input schema lists no keys, the first call checks instead (a warning)."""
        if not self.untrusted:
            return
        keys = chain_keys(self.runnable)
        if keys is None:
            self._check_on_first_call = True
            return
        top, inside = keys
        unknown = [k for k in self.untrusted if k not in inside]
        if unknown:
            produced = sorted(inside - top)
            raise ConfigError(
                f"untrusted key(s) {unknown} never reach this chain, so nothing would be marked "
                f"as data: its input takes {sorted(top)}"
                + (f" and its steps produce {produced}" if produced else "")
                + "; check the spelling"
            )

    def _check_first_call(self, scope: GuardScope) -> None:
        """On the first call of a guard whose chain lists no input keys: warn about untrusted
        keys that appeared nowhere (neither in the input nor in any step's input or output)."""
        if not self._check_on_first_call:
            return
        self._check_on_first_call = False
        seen = scope.seen_keys()
        missing = [k for k in self.untrusted if k not in seen]
        if missing:
            logger.warning(
                "GuardedRunnable: untrusted key(s) %s appeared nowhere in its first call (keys "
                "seen in the input and in the chain's steps: %s), so nothing under that name "
                "was marked as data; check the spelling (checked once: the chain's input "
                "schema does not list its keys)",
                missing,
                seen[:20],
            )

    @property
    def InputType(self) -> Any:
        return self.runnable.InputType

    @property
    def OutputType(self) -> Any:
        return dict[str, Any] if self.include_report else self.runnable.OutputType

    def get_input_schema(self, config: RunnableConfig | None = None) -> Any:
        return self.runnable.get_input_schema(config)

    @property
    def config_specs(self) -> Any:
        return self.runnable.config_specs

    # -- outcome -------------------------------------------------------------------------------
    def _new_scope(self) -> GuardScope:
        return GuardScope(
            self.untrusted,
            policies=self.policies,
            retrieved_documents=self.untrusted_documents,
            tool_outputs=self.untrusted_tool_outputs,
        )

    def _report(
        self,
        scope: GuardScope,
        config: RunnableConfig,
        blocked: PromptInjectionBlocked | None = None,
    ) -> ChainVerdict:
        """The scope's chain verdict (``blocked``: the block that reached the guard, None when
        the chain answered), dispatched as a custom event from the guard's run."""
        self._check_first_call(scope)
        report = scope.report(blocked)
        dispatch_custom_event(VERDICT_EVENT, report.model_dump(mode="json"), config=config)
        return report

    async def _areport(
        self,
        scope: GuardScope,
        config: RunnableConfig,
        blocked: PromptInjectionBlocked | None = None,
    ) -> ChainVerdict:
        self._check_first_call(scope)
        report = scope.report(blocked)
        await adispatch_custom_event(VERDICT_EVENT, report.model_dump(mode="json"), config=config)
        return report

    def _deliver(self, output: Any, report: ChainVerdict) -> Any:
        if isinstance(output, BaseMessage):
            metadata = {
                **output.response_metadata,
                CHAIN_METADATA_KEY: report.model_dump(mode="json"),
            }
            output = output.model_copy(update={"response_metadata": metadata})
        return AddableDict(output=output, guardrail=report) if self.include_report else output

    def _error(self, exc: PromptInjectionBlocked, report: ChainVerdict) -> GuardrailBlockedError:
        return GuardrailBlockedError(
            f"guarded chain blocked: {report.reason}", exc.verdict, report.verdicts, report
        )

    def _blocked(self, exc: PromptInjectionBlocked, report: ChainVerdict) -> Any:
        if self.on_block == "raise":
            raise self._error(exc, report) from exc
        refusal = self.refusal(report) if callable(self.refusal) else self.refusal
        return self._deliver(refusal, report)

    # -- invoke --------------------------------------------------------------------------------
    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        scope = self._new_scope()
        run = partial(self._invoke, scope)
        return self._call_with_config(run, input, with_handler(config, scope), **kwargs)

    def _invoke(
        self, scope: GuardScope, input: Any, run_manager: Any, config: RunnableConfig, **kw: Any
    ) -> Any:
        scope.capture(input)
        try:
            output = self.runnable.invoke(input, config, **kw)
        except PromptInjectionBlocked as exc:
            report = self._report(scope, config, exc)
            return self._blocked(exc, report)
        report = self._report(scope, config)
        return self._deliver(output, report)

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        scope = self._new_scope()
        run = partial(self._ainvoke, scope)
        return await self._acall_with_config(run, input, with_handler(config, scope), **kwargs)

    async def _ainvoke(
        self, scope: GuardScope, input: Any, run_manager: Any, config: RunnableConfig, **kw: Any
    ) -> Any:
        scope.capture(input)
        try:
            output = await self.runnable.ainvoke(input, config, **kw)
        except PromptInjectionBlocked as exc:
            report = await self._areport(scope, config, exc)
            return self._blocked(exc, report)
        report = await self._areport(scope, config)
        return self._deliver(output, report)

    # -- stream --------------------------------------------------------------------------------
    def _chunk(self, chunk: Any) -> Any:
        return AddableDict(output=chunk) if self.include_report else chunk

    def transform(
        self, input: Iterator[Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[Any]:
        scope = self._new_scope()
        run = partial(self._transform, scope)
        yield from self._transform_stream_with_config(
            input, run, with_handler(config, scope), **kwargs
        )

    def stream(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        yield from self.transform(iter([input]), config, **kwargs)

    def _transform(
        self, scope: GuardScope, inputs: Iterator[Any], run_manager: Any, config: Any, **kw: Any
    ) -> Iterator[Any]:
        final = _gather(inputs)
        scope.capture(final)
        emitted = False
        try:
            for chunk in self.runnable.stream(final, config, **kw):
                emitted = True
                yield self._chunk(chunk)
        except PromptInjectionBlocked as exc:
            report = self._report(scope, config, exc)
            if emitted:
                raise self._error(exc, report) from exc
            yield self._blocked(exc, report)
            return
        report = self._report(scope, config)
        if self.include_report:
            yield AddableDict(guardrail=report)

    async def atransform(
        self, input: AsyncIterator[Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        scope = self._new_scope()
        run = partial(self._atransform, scope)
        async for chunk in self._atransform_stream_with_config(
            input, run, with_handler(config, scope), **kwargs
        ):
            yield chunk

    async def astream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        async def single() -> AsyncIterator[Any]:
            yield input

        async for chunk in self.atransform(single(), config, **kwargs):
            yield chunk

    async def _atransform(
        self,
        scope: GuardScope,
        inputs: AsyncIterator[Any],
        run_manager: Any,
        config: Any,
        **kw: Any,
    ) -> AsyncIterator[Any]:
        final = await _agather(inputs)
        scope.capture(final)
        emitted = False
        try:
            async for chunk in self.runnable.astream(final, config, **kw):
                emitted = True
                yield self._chunk(chunk)
        except PromptInjectionBlocked as exc:
            report = await self._areport(scope, config, exc)
            if emitted:
                raise self._error(exc, report) from exc
            yield self._blocked(exc, report)
            return
        report = await self._areport(scope, config)
        if self.include_report:
            yield AddableDict(guardrail=report)
