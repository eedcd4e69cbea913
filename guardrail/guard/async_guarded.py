"""``AsyncGuardedLLM``: policies over the ``AsyncHookedLLM``, for servers and async apps.

The same ``GuardCore``, ``Decider`` and ``GuardedCall`` as ``GuardedLLM`` (same settings,
policies, stop plans, verdicts, metrics and failures); what the async engine adds is streaming
with the decision first: ``stream`` yields the verdict with the request's first chunk, right
after its prefill, so nothing of a blocked request is ever streamed, and a request the policies
will block stops inside the engine after its prefill.

Retry policies (``retry_with_steering``) are refused here: the async engine cannot steer yet.

Example:
    >>> async def main():  # doctest: +SKIP
    ...     guard = await AsyncGuardedLLM.create()
    ...     async for chunk in guard.stream(("Summarize the email.", "Hi, lunch at noon?")):
    ...         print(chunk.verdict.action if chunk.verdict else "", chunk.text)
    ...     guard.close()
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guardrail.embedded import model_or_embedded
from guardrail.engine.async_hooked import AsyncHookedLLM
from guardrail.engine.install import engine_probe_config
from guardrail.engine.types import GuardedChunk, GuardedOutput, PositionLogprobs
from guardrail.errors import ConfigError, EngineDeadError, GuardrailError
from guardrail.guard.call import GuardedCall
from guardrail.guard.core import GuardCore
from guardrail.guard.decider import (
    DEFAULT_REFUSAL,
    Decider,
    GuardedResult,
    OnBlock,
    VerdictObserver,
)
from guardrail.guard.settings import GuardSettings
from guardrail.policy.kinds import PerRequestPolicies, Policy, PolicyLike
from guardrail.policy.verdict import Action, Verdict
from guardrail.probe.config import ModelProbeConfig
from guardrail.probe.prompts import RequestLike

__all__ = ["AsyncGuardedLLM", "GuardedStreamChunk"]


@dataclass(frozen=True)
class GuardedStreamChunk:
    """One chunk of a guarded stream: text and token ids new since the previous chunk.

    The first chunk carries the request's ``verdict``. A blocked request's stream is that one
    chunk: the refusal text (``on_block="refuse"``), no token ids, ``finish_reason`` "blocked"
    (and no logprobs). ``logprobs``: one entry per token id, when the sampling params asked.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None
    verdict: Verdict | None = None
    logprobs: tuple[PositionLogprobs, ...] | None = None


def _refuse_retries(policies: Sequence[Policy]) -> None:
    """The async engine cannot steer: an enforced retry policy would retry unsteered."""
    for policy in policies:
        if policy.action is Action.RETRY_WITH_STEERING and not policy.shadow:
            raise ConfigError(
                f"policy {policy.name!r} retries with steering, which the async engine cannot "
                "do yet; use action='block' (or GuardedLLM on the offline engine)"
            )


class AsyncGuardedLLM(GuardCore[AsyncHookedLLM]):
    """A guarded ``AsyncHookedLLM``: ``stream`` one request, or ``generate`` a list.

    Arguments are those of ``GuardedLLM``; build it with ``await AsyncGuardedLLM.create(...)``
    (starts an engine this guard closes) or ``AsyncGuardedLLM(engine, ...)`` (a shared engine;
    ``owns_engine=True`` makes ``close()`` close it too).
    Concurrent calls from one event loop are the normal use: vLLM batches them.
    """

    def __init__(
        self,
        engine: AsyncHookedLLM,
        policies: Sequence[PolicyLike] | None = None,
        *,
        on_block: OnBlock = "refuse",
        refusal_text: str = DEFAULT_REFUSAL,
        metrics: VerdictObserver | None = None,
        early_block: bool = True,
        model_name: str | None = None,
        owns_engine: bool = False,
    ) -> None:
        settings = GuardSettings(
            on_block=on_block,
            refusal_text=refusal_text,
            metrics=metrics,
            early_block=early_block,
            model_name=model_name,
        )
        super().__init__(engine, _decider(engine.config, policies, settings), owns_engine)

    @classmethod
    async def create(
        cls,
        model: str | Path | None = None,
        policies: Sequence[PolicyLike] | None = None,
        *,
        probe_config: ModelProbeConfig | str | Path | None = None,
        on_block: OnBlock = "refuse",
        refusal_text: str = DEFAULT_REFUSAL,
        metrics: VerdictObserver | None = None,
        early_block: bool = True,
        model_name: str | None = None,
        **engine_kwargs: Any,
    ) -> AsyncGuardedLLM:
        """Start an engine and guard it; everything is checked before the engine starts."""
        settings = GuardSettings(
            on_block=on_block,
            refusal_text=refusal_text,
            metrics=metrics,
            early_block=early_block,
            model_name=model_name,
        )
        model = model_or_embedded(model)
        config = engine_probe_config(str(model), probe_config, engine_kwargs, announce=False)
        checked = _decider(config, policies, settings).policies  # before the engine starts
        engine = await AsyncHookedLLM.create(model, config, **engine_kwargs)
        try:
            return cls(engine, checked, owns_engine=True, **settings.keywords())
        except BaseException:  # e.g. Ctrl-C: the engine this call started is not left running
            engine.close()
            raise

    # -- one request, streamed -------------------------------------------------------------------
    async def stream(
        self,
        request: RequestLike,
        sampling_params: Any | None = None,
        *,
        policies: Sequence[PolicyLike] | None = None,
        request_id: str | None = None,
    ) -> AsyncGenerator[GuardedStreamChunk, None]:
        """Generate one request under the policies, chunk by chunk, the verdict first.

        The first chunk carries the verdict and arrives right after the prefill. A blocked
        request yields that one chunk (the refusal) with ``on_block="refuse"``, or raises
        ``PromptInjectionBlocked`` before yielding anything with ``on_block="raise"``; its
        generated tokens, if any, are never streamed. Raises ``RequestError`` (or
        ``ConfigError`` for bad ``policies``) before anything runs for an invalid request, and
        ``EngineDeadError`` when the engine dies: a request that had no verdict yet is recorded
        as blocked, fail-closed; one already decided keeps its verdict and its stream ends
        with the error.
        """
        call = GuardedCall(self.decider, self.engine, [request], sampling_params, _one(request_id))
        call.resolve(_one(policies), _refuse_retries)
        if call.errors:
            raise call.errors[0]
        batch = call.batch([0])
        chunks = self.engine.stream(
            request,
            sampling_params,
            stop_below=batch.stop_below[0],
            stop_on_probe_error=batch.stop_on_probe_error[0],
            probe_key=batch.probe_keys[0],
        )
        with self.decider.in_flight(1):
            try:
                async for chunk in self._guarded(call, chunks):
                    yield chunk
            finally:
                await chunks.aclose()  # aborts the request if it still runs

    async def _guarded(
        self, call: GuardedCall, chunks: AsyncGenerator[GuardedChunk, None]
    ) -> AsyncIterator[GuardedStreamChunk]:
        """The engine's chunks of one request, its verdict on the first: a blocked request's
        stream is its refusal (or ``PromptInjectionBlocked``), an allowed one's its chunks."""
        rid = call.ids[0]
        try:
            first = await anext(chunks, None)
        except EngineDeadError as exc:  # no verdict yet: fail closed and record it
            call.fail(exc)
            raise
        if first is None:  # vLLM yields at least one output per request
            raise GuardrailError(f"request {rid}: the engine returned no output")
        result = self._decide(call, first)
        if result.blocked:  # the refusal, and nothing the model generated
            await chunks.aclose()  # aborts the request if it still runs
            yield GuardedStreamChunk(
                rid, result.text, (), True, result.finish_reason, result.verdict
            )
            return
        yield _stream_chunk(rid, first, result.verdict)
        async for chunk in chunks:  # decided: an engine death now ends the stream as it is
            yield _stream_chunk(rid, chunk)

    @staticmethod
    def _decide(call: GuardedCall, first: GuardedChunk) -> GuardedResult:
        """A request's result from its first chunk (prompt, score, first tokens), recorded in
        the metrics; ``on_block="raise"`` raises ``PromptInjectionBlocked`` for a blocked one."""
        output = GuardedOutput(
            index=0,
            prompt=first.prompt,
            text=first.text,
            token_ids=list(first.token_ids),
            finish_reason=first.finish_reason,
            num_cached_tokens=first.num_cached_tokens,
            probe=first.probe,
            logprobs=first.logprobs,
        )
        result = call.result(0, output)
        if result.verdict is None:  # the first chunk always has a prompt and a probe result
            raise GuardrailError(f"request {call.ids[0]}: the engine returned no score")
        return call.finish([result])[0]

    # -- many requests, whole answers ------------------------------------------------------------
    async def generate(
        self,
        requests: Sequence[RequestLike],
        sampling_params: Any | Sequence[Any] | None = None,
        *,
        policies: PerRequestPolicies = None,
        request_ids: Sequence[str | None] | None = None,
    ) -> list[GuardedResult]:
        """Generate every request under the policies; one ``GuardedResult`` per request, in
        order. Same arguments, per-request failures and ``on_block`` behaviour as
        ``GuardedLLM.generate``."""
        call = GuardedCall(self.decider, self.engine, requests, sampling_params, request_ids)
        call.resolve(policies, _refuse_retries)
        outputs: list[GuardedOutput] = []
        try:
            if call.send:
                with self.decider.in_flight(len(call.send)):
                    outputs = await call.batch(call.send).submit(self.engine.generate)
        except EngineDeadError as exc:
            call.fail(exc)
            raise
        return call.finish(call.results(outputs))

    async def __aenter__(self) -> AsyncGuardedLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


def _decider(
    config: ModelProbeConfig, policies: Sequence[PolicyLike] | None, settings: GuardSettings
) -> Decider:
    """The guard's ``Decider``; retry policies are refused (the async engine cannot steer)."""
    decider = Decider(config, policies, settings)
    _refuse_retries(decider.policies)
    return decider


def _one(value: Any) -> list[Any] | None:
    """A per-request argument of a one-request call: None (the defaults) or a list of one."""
    return None if value is None else [value]


def _stream_chunk(
    request_id: str, chunk: GuardedChunk, verdict: Verdict | None = None
) -> GuardedStreamChunk:
    return GuardedStreamChunk(
        request_id,
        chunk.text,
        tuple(chunk.token_ids),
        chunk.finished,
        chunk.finish_reason,
        verdict,
        chunk.logprobs,
    )
