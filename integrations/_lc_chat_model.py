"""``GuardedChatModel``: a LangChain chat model whose every call is probed inside the serving model.

The probe's verdict travels in the answer's ``response_metadata["guardrail"]`` (a JSON dict of
``guardrail.policy.Verdict``); a blocked call raises ``GuardrailBlockedError`` before any text is
returned or streamed. Inside a ``GuardedRunnable`` the model marks the guard's untrusted values
as data and reports its verdict to the guard; outside one, system/user messages are trusted and
tool (and assistant) messages are data, as in ``guardrail.probe.prompts``.

Streaming: ``vllm.LLM.generate`` is not incremental, so ``stream``/``astream`` generate the whole
answer, decide, and then emit it in word-sized chunks (token callbacks fire per chunk); a
blocked call raises before the first chunk. ``AsyncGuardedChatModel`` (on vLLM's ``AsyncLLM``)
streams tokens as they are generated.

Standard LangChain constructor arguments are accepted (the standard test suite,
``langchain-tests``, passes; see docs/langchain.md): ``max_tokens``, ``temperature``, ``stop``,
``timeout`` and ``streaming`` act; ``max_retries`` and ``api_key`` are accepted and ignored
(nothing goes over a network). Tool calling, structured output and non-text inputs are not
supported: ``bind_tools`` / ``with_structured_output`` raise ``NotImplementedError`` saying so.

Example:
    >>> from guardrail.guard.guarded import GuardedLLM
    >>> model = GuardedChatModel(guarded=GuardedLLM())  # doctest: +SKIP
    >>> model.invoke("Hi").response_metadata["guardrail"]["action"]  # doctest: +SKIP
    'allow'
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.runnables.config import ensure_config
from langchain_core.tools import BaseTool
from pydantic import ConfigDict, Field, SecretStr

from guardrail.errors import ConfigError, RequestError
from guardrail.guard.batcher import batcher_for
from guardrail.guard.guarded import GuardedLLM, GuardedResult
from guardrail.policy import Policy
from guardrail.policy.verdict import Verdict
from guardrail.probe.prompts import Message

from ._lc_marking import to_guardrail_messages
from ._lc_scope import GuardrailBlockedError, GuardScope, scope_policies, scopes_of

METADATA_KEY = "guardrail"
"""Key of the verdict in an answer's ``response_metadata``."""

SAMPLING_OPTIONS = ("max_tokens", "temperature", "top_p", "seed")
"""Sampling options: fields, or per call (``invoke(..., max_tokens=...)`` / ``bind``)."""
CALL_OPTIONS = (*SAMPLING_OPTIONS, "stop", "model", "stream")
"""Every option a call accepts (``model`` only when it names the served model)."""


@dataclass(frozen=True)
class ModelCall:
    """One prepared call: the marked request, its sampling options, and the guard scopes (if
    any) whose policies apply and which collect its verdict."""

    messages: list[Message]
    options: dict[str, Any]
    policies: tuple[Policy, ...] | None
    scopes: tuple[GuardScope, ...]


@dataclass(frozen=True)
class ModelAnswer:
    """What a guarded backend answered for one call."""

    text: str
    verdict: Verdict
    num_generated_tokens: int = 0
    finish_reason: str | None = None


def _current_scopes(run_manager: Any) -> tuple[GuardScope, ...]:
    """Guard scopes of this call: from the run manager, or (``_stream`` gets none) from the
    config of the runnable context the model runs in."""
    if run_manager is not None:
        return tuple(scopes_of(run_manager))
    callbacks = ensure_config().get("callbacks")
    handlers = callbacks if isinstance(callbacks, list) else getattr(callbacks, "handlers", [])
    return tuple(h for h in handlers or [] if isinstance(h, GuardScope))


def _pieces(text: str) -> list[str]:
    """Word-sized stream chunks that join back to ``text`` exactly."""
    return [p for p in re.findall(r"\S*\s*", text) if p] or [""]


class GuardedChatModelBase(BaseChatModel):
    """What real and fake guarded chat models share: prepare the marked request, get an
    answer from ``_complete``/``_acomplete``, record the verdict, raise on block, shape the
    message or the stream. Subclasses implement the two ``_complete`` methods."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    max_tokens: int = Field(default=256, ge=1)
    """Most tokens generated per call."""
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] | None = None
    """Stop strings: generation ends before the first one; a per-call ``stop`` replaces them."""
    streaming: bool = False
    """``invoke`` goes through ``stream`` (token callbacks fire per chunk), as in LangChain."""
    timeout: float | None = Field(default=None, gt=0)
    """Seconds a call waits for its answer from the engine's micro-batcher (queue plus
    generation) before it raises ``TimeoutError``; None waits as long as it takes."""
    max_retries: int | None = Field(default=None, ge=0)
    """Accepted for drop-in compatibility and ignored: nothing is sent over a network, so
    nothing is retried (a failed or blocked call raises at once)."""
    api_key: SecretStr | None = Field(default=None, exclude=True, repr=False)
    """Accepted for drop-in compatibility and ignored: the engine runs in this process."""

    # -- subclass hooks ----------------------------------------------------------------------
    def _complete(self, call: ModelCall) -> ModelAnswer:
        raise NotImplementedError

    async def _acomplete(self, call: ModelCall) -> ModelAnswer:
        raise NotImplementedError

    def _model_label(self) -> str:
        return self._llm_type

    _ls_provider: ClassVar[str] = "guardrail"  # tracing's ``ls_provider``

    # -- LangChain's standard surface -------------------------------------------------------
    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        """Tracing parameters: the served model's name (a per-call ``model`` is reported as
        asked; the call itself refuses a name other than the served model's)."""
        model = kwargs.get("model")
        params = LangSmithParams(
            ls_provider=self._ls_provider,
            ls_model_name=model if isinstance(model, str) else self._model_label(),
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
        )
        stops = stop if stop is not None else self.stop
        if stops:
            params["ls_stop"] = list(stops)
        return params

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | None = None,
        **kwargs: Any,
    ) -> Runnable[Any, AIMessage]:
        """Not supported: raises ``NotImplementedError`` (``with_structured_output`` too)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not support tool calling or structured output: the "
            "guarded engine generates plain text and parses no tool calls. Guard a tool-calling "
            "model's inputs with InputGuard instead (docs/langchain.md)."
        )

    # -- the shared flow ---------------------------------------------------------------------
    def _prepare(
        self, messages: Sequence[BaseMessage], stop: list[str] | None, run_manager: Any, kw: Any
    ) -> ModelCall:
        unknown = set(kw) - set(CALL_OPTIONS)
        if unknown:
            raise ConfigError(
                f"{type(self).__name__} got unsupported call options {sorted(unknown)}; it "
                f"accepts {', '.join(SAMPLING_OPTIONS)}, stop and model (tools are not "
                "supported)"
            )
        model = kw.get("model")
        if model is not None and model != self._model_label():
            raise ConfigError(
                f"{type(self).__name__} serves {self._model_label()!r} only; a call cannot "
                f"switch to model={model!r}"
            )
        options = {k: kw.get(k, getattr(self, k)) for k in SAMPLING_OPTIONS}
        stops = stop if stop is not None else self.stop
        if stops:
            options["stop"] = list(stops)
        scopes = _current_scopes(run_manager)
        values = [v for scope in scopes for v in scope.untrusted_values()]
        marked, found = to_guardrail_messages(messages, values)
        for scope in scopes:
            scope.note_marked(found)
        return ModelCall(marked, options, scope_policies(scopes), scopes)

    @staticmethod
    def _settle(call: ModelCall, answer: ModelAnswer) -> None:
        """Report the verdict to every enclosing guard, then refuse a blocked answer."""
        for scope in call.scopes:
            scope.record(answer.verdict)
        if answer.verdict.blocked:
            verdict = answer.verdict
            raise GuardrailBlockedError(
                f"prompt injection blocked (request {verdict.request_id}): {verdict.reason}",
                verdict,
            )

    def _usage(self, answer: ModelAnswer) -> UsageMetadata:
        prompt, generated = answer.verdict.num_prompt_tokens, answer.num_generated_tokens
        return UsageMetadata(
            input_tokens=prompt, output_tokens=generated, total_tokens=prompt + generated
        )

    def _end_metadata(self, answer: ModelAnswer) -> dict[str, Any]:
        return {"finish_reason": answer.finish_reason, "model_name": self._model_label()}

    def _message(self, answer: ModelAnswer) -> AIMessage:
        metadata = {
            METADATA_KEY: answer.verdict.model_dump(mode="json"),
            **self._end_metadata(answer),
        }
        return AIMessage(
            content=answer.text, response_metadata=metadata, usage_metadata=self._usage(answer)
        )

    def _chunks(self, answer: ModelAnswer) -> Iterator[ChatGenerationChunk]:
        """The answer as chunks: the verdict on the first, finish reason and usage on the last."""
        pieces = _pieces(answer.text)
        for i, piece in enumerate(pieces):
            metadata: dict[str, Any] = {}
            if i == 0:
                metadata[METADATA_KEY] = answer.verdict.model_dump(mode="json")
            last = i == len(pieces) - 1
            if last:
                metadata.update(self._end_metadata(answer))
            chunk = AIMessageChunk(
                content=piece,
                response_metadata=metadata,
                usage_metadata=self._usage(answer) if last else None,
                chunk_position="last" if last else None,
            )
            yield ChatGenerationChunk(message=chunk)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> ChatResult:
        call = self._prepare(messages, stop, run_manager, kwargs)
        answer = self._complete(call)
        self._settle(call, answer)
        return ChatResult(generations=[ChatGeneration(message=self._message(answer))])

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> ChatResult:
        call = self._prepare(messages, stop, run_manager, kwargs)
        answer = await self._acomplete(call)
        self._settle(call, answer)
        return ChatResult(generations=[ChatGeneration(message=self._message(answer))])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        call = self._prepare(messages, stop, run_manager, kwargs)
        answer = self._complete(call)
        self._settle(call, answer)  # decided before the first chunk
        yield from self._chunks(answer)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        call = self._prepare(messages, stop, run_manager, kwargs)
        answer = await self._acomplete(call)
        self._settle(call, answer)
        for chunk in self._chunks(answer):
            yield chunk


class GuardedChatModel(GuardedChatModelBase):
    """A LangChain chat model backed by a ``GuardedLLM``: the probe runs inside the serving
    model during each call's own prefill, the ``GuardedLLM``'s policies decide (a surrounding
    ``GuardedRunnable`` may override them), and a block raises ``GuardrailBlockedError``.

    The ``GuardedLLM``'s own ``on_block`` is not used: the model always raises on block, and a
    ``GuardedRunnable`` turns that into a refusal when asked to. Calls from threads and event
    loops are batched onto the engine by one worker per engine (``guardrail.guard.batcher``),
    so ``batch``, ``abatch`` and concurrent ``ainvoke`` calls share ``generate`` batches.

    Arguments: ``guarded`` (the ``GuardedLLM``); ``max_tokens``, ``temperature``, ``top_p``,
    ``seed`` and ``stop`` go to vLLM's ``SamplingParams``; ``timeout`` bounds how long a call
    waits for the engine (``TimeoutError``); ``streaming=True`` makes ``invoke`` stream;
    ``max_retries`` and ``api_key`` are accepted and ignored (no network, no service). Tool
    calling and structured output are not supported (``bind_tools`` raises
    ``NotImplementedError``).

    Example:
        >>> model = GuardedChatModel(guarded=guarded_llm, max_tokens=64)  # doctest: +SKIP
        >>> chain = prompt | model | StrOutputParser()  # doctest: +SKIP
        >>> chain.invoke({"question": "Why is the sky blue?"})  # doctest: +SKIP
        'Because ...'
    """

    guarded: GuardedLLM = Field(exclude=True)

    @property
    def _llm_type(self) -> str:
        return "guardrail-vllm"

    _ls_provider: ClassVar[str] = "vllm"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self._model_label(),
            **{k: getattr(self, k) for k in SAMPLING_OPTIONS},
            "stop": self.stop,
        }

    def _model_label(self) -> str:
        return self.guarded.model_name

    def _submit(self, call: ModelCall) -> Any:
        from vllm import SamplingParams

        options = {k: v for k, v in call.options.items() if v is not None}
        return batcher_for(self.guarded).submit(
            self.guarded, call.messages, SamplingParams(**options), policies=call.policies
        )

    @staticmethod
    def _answer(result: GuardedResult) -> ModelAnswer:
        if result.error is not None:
            raise result.error
        if result.verdict is None:
            raise RequestError("the guarded engine returned no verdict for this request")
        return ModelAnswer(
            text=result.text,
            verdict=result.verdict,
            num_generated_tokens=result.num_generated_tokens,
            finish_reason=result.finish_reason,
        )

    def _timed_out(self) -> TimeoutError:
        return TimeoutError(
            f"{type(self).__name__}: no answer from the engine within timeout={self.timeout}s "
            "(waiting in its micro-batcher queue plus generation). The request was withdrawn if "
            "it had not started; otherwise the engine finishes it and its answer is discarded."
        )

    def _complete(self, call: ModelCall) -> ModelAnswer:
        future = self._submit(call)
        done, _ = concurrent.futures.wait([future], timeout=self.timeout)
        if not done:
            future.cancel()
            raise self._timed_out()
        return self._answer(future.result())

    async def _acomplete(self, call: ModelCall) -> ModelAnswer:
        waiting = asyncio.wrap_future(self._submit(call))
        done, _ = await asyncio.wait([waiting], timeout=self.timeout)
        if not done:
            waiting.cancel()  # cancels the engine job too, unless it already started
            raise self._timed_out()
        return self._answer(waiting.result())
