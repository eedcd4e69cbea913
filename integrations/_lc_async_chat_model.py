"""``AsyncGuardedChatModel``: a LangChain chat model on the ``AsyncGuardedLLM``, streaming for real.

Tokens are streamed as the engine generates them; the verdict is decided on the first chunk,
right after the prefill, so a blocked call raises ``GuardrailBlockedError`` before any text.
vLLM's ``AsyncLLM`` belongs to the event loop it was started on: calls from that loop run
directly, calls from other threads (``invoke``, ``stream``) or other loops are handed to it,
which needs that loop running (e.g. the server's); otherwise they raise ``ConfigError``.

Example:
    >>> guard = await AsyncGuardedLLM.create()  # doctest: +SKIP
    >>> model = AsyncGuardedChatModel(guarded=guard)  # doctest: +SKIP
    >>> async for chunk in model.astream("Name three colors."):  # doctest: +SKIP
    ...     print(chunk.content, end="")
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any, ClassVar

from langchain_core.messages import AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGenerationChunk
from pydantic import Field

from guardrail.errors import ConfigError, PromptInjectionBlocked
from guardrail.guard.async_guarded import AsyncGuardedLLM, GuardedStreamChunk

from ._lc_chat_model import (
    METADATA_KEY,
    GuardedChatModelBase,
    ModelAnswer,
    ModelCall,
)

__all__ = ["AsyncGuardedChatModel"]

_DONE = object()


class AsyncGuardedChatModel(GuardedChatModelBase):
    """A LangChain chat model backed by an ``AsyncGuardedLLM`` (see the module docstring).

    Arguments as ``GuardedChatModel``'s, with ``guarded`` an ``AsyncGuardedLLM``; ``timeout``
    bounds each wait for the next chunk.
    """

    guarded: AsyncGuardedLLM = Field(exclude=True)

    @property
    def _llm_type(self) -> str:
        return "guardrail-vllm-async"

    _ls_provider: ClassVar[str] = "vllm"

    def _model_label(self) -> str:
        return self.guarded.model_name

    # -- the stream, on the engine's loop --------------------------------------------------------
    async def _chunks_of(self, call: ModelCall) -> AsyncGenerator[GuardedStreamChunk, None]:
        """The guard's chunks for one call; the first one has the verdict (block included)."""
        from vllm import SamplingParams

        options = {k: v for k, v in call.options.items() if v is not None}
        stream = self.guarded.stream(
            call.messages, SamplingParams(**options), policies=call.policies
        )
        try:
            async for chunk in stream:
                yield chunk
        except PromptInjectionBlocked as blocked:  # the guard's on_block="raise"
            yield GuardedStreamChunk(
                blocked.verdict.request_id, "", (), True, "blocked", blocked.verdict
            )

    def _engine_loop(self) -> asyncio.AbstractEventLoop:
        loop = self.guarded.engine.loop
        if loop is None or loop.is_closed():
            raise ConfigError("the async engine's event loop is gone; start a new engine")
        return loop

    def _handed_over(self, coro: Any, loop: asyncio.AbstractEventLoop) -> Any:
        if not loop.is_running():
            coro.close()
            raise ConfigError(
                f"{type(self).__name__}: the async engine's event loop is not running, so a "
                "call from another thread or loop cannot reach it; call ainvoke/astream on that "
                "loop, or keep it running (e.g. a server's loop) while calling from threads"
            )
        return asyncio.run_coroutine_threadsafe(coro, loop)

    async def _achunks(self, call: ModelCall) -> AsyncIterator[GuardedStreamChunk]:
        """``_chunks_of`` from whichever loop calls: directly on the engine's, else handed over."""
        loop = self._engine_loop()
        if asyncio.get_running_loop() is loop:
            async for chunk in self._chunks_of(call):
                yield chunk
            return
        stream = self._chunks_of(call)
        try:
            while True:
                item = await asyncio.wrap_future(self._handed_over(_next(stream), loop))
                if item is _DONE:
                    return
                yield item
        finally:  # a consumer that stops early: end the request on the engine's loop
            asyncio.run_coroutine_threadsafe(stream.aclose(), loop)

    def _sync_chunks(self, call: ModelCall) -> Iterator[GuardedStreamChunk]:
        loop = self._engine_loop()
        stream = self._chunks_of(call)
        try:
            while True:
                item = self._handed_over(_next(stream), loop).result(self.timeout)
                if item is _DONE:
                    return
                yield item
        finally:  # a consumer that stops early: end the request on the engine's loop
            asyncio.run_coroutine_threadsafe(stream.aclose(), loop)

    # -- LangChain's four entry points -----------------------------------------------------------
    def _message_chunk(
        self, chunk: GuardedStreamChunk, answer: ModelAnswer | None
    ) -> ChatGenerationChunk:
        metadata: dict[str, Any] = {}
        if chunk.verdict is not None:
            metadata[METADATA_KEY] = chunk.verdict.model_dump(mode="json")
        if answer is not None:  # the last chunk
            metadata.update(self._end_metadata(answer))
        message = AIMessageChunk(
            content=chunk.text,
            response_metadata=metadata,
            usage_metadata=self._usage(answer) if answer is not None else None,
            chunk_position="last" if answer is not None else None,
        )
        return ChatGenerationChunk(message=message)

    def _follow(
        self, call: ModelCall, chunk: GuardedStreamChunk, state: dict[str, Any]
    ) -> ChatGenerationChunk:
        """One chunk of the call: the first settles the verdict (raises on block)."""
        if chunk.verdict is not None:
            state["verdict"] = chunk.verdict
            self._settle(call, ModelAnswer(text="", verdict=chunk.verdict))
        state["tokens"] = state.get("tokens", 0) + len(chunk.token_ids)
        answer = None
        if chunk.finished:
            answer = ModelAnswer(
                text="",
                verdict=state["verdict"],
                num_generated_tokens=state["tokens"],
                finish_reason=chunk.finish_reason,
            )
        return self._message_chunk(chunk, answer)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        call = self._prepare(messages, stop, run_manager, kwargs)
        state: dict[str, Any] = {}
        for chunk in self._sync_chunks(call):
            generation = self._follow(call, chunk, state)
            if run_manager is not None:
                run_manager.on_llm_new_token(chunk.text, chunk=generation)
            yield generation

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        call = self._prepare(messages, stop, run_manager, kwargs)
        state: dict[str, Any] = {}
        async for chunk in self._achunks(call):
            generation = self._follow(call, chunk, state)
            if run_manager is not None:
                await run_manager.on_llm_new_token(chunk.text, chunk=generation)
            yield generation

    def _complete(self, call: ModelCall) -> ModelAnswer:
        return _collect(list(self._sync_chunks(call)))

    async def _acomplete(self, call: ModelCall) -> ModelAnswer:
        return _collect([chunk async for chunk in self._achunks(call)])


async def _next(stream: AsyncIterator[GuardedStreamChunk]) -> Any:
    """The stream's next chunk, or ``_DONE`` (never StopAsyncIteration across loops)."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return _DONE


def _collect(chunks: list[GuardedStreamChunk]) -> ModelAnswer:
    verdict = chunks[0].verdict
    if verdict is None:
        raise ConfigError("the guard returned no verdict on the first chunk")
    return ModelAnswer(
        text="".join(c.text for c in chunks) if not verdict.blocked else "",
        verdict=verdict,
        num_generated_tokens=sum(len(c.token_ids) for c in chunks),
        finish_reason=chunks[-1].finish_reason,
    )
