"""``AsyncGuardedLLM``: policies over the ``AsyncHookedLLM``, for servers and async apps.

The same ``Decider`` as ``GuardedLLM`` (same policies, stop plans, verdicts and metrics); what
the async engine adds is streaming with the decision first: ``stream`` yields the verdict with the
request's first chunk, right after its prefill, so nothing of a blocked request is ever
streamed, and a request the policies will block stops inside the engine after its prefill.

Retry policies (``retry_with_steering``) are refused here: the async engine cannot steer yet.

Example:
    >>> async def main():  # doctest: +SKIP
    ...     guard = await AsyncGuardedLLM.create()
    ...     async for chunk in guard.stream(("Summarize the email.", "Hi, lunch at noon?")):
    ...         print(chunk.verdict.action if chunk.verdict else "", chunk.text)
    ...     guard.close()
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guardrail.embedded import model_or_embedded
from guardrail.engine.async_hooked import AsyncHookedLLM
from guardrail.engine.install import engine_probe_config
from guardrail.engine.types import GuardedChunk, GuardedOutput, PositionLogprobs
from guardrail.errors import (
    ConfigError,
    EngineDeadError,
    GuardrailError,
    PromptInjectionBlocked,
)
from guardrail.guard.decider import (
    BLOCKED_FINISH_REASON,
    DEFAULT_REFUSAL,
    Decider,
    GuardedResult,
    OnBlock,
    VerdictObserver,
    check_requests,
)
from guardrail.guard.decider import request_ids as ids_for
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


class AsyncGuardedLLM:
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
        decider = Decider(
            engine.config,
            policies,
            on_block=on_block,
            refusal_text=refusal_text,
            metrics=metrics,
            early_block=early_block,
            model_name=model_name,
        )
        _refuse_retries(decider.policies)
        self._setup(engine, decider, owns_engine)

    def _setup(self, engine: AsyncHookedLLM, decider: Decider, owns_engine: bool) -> None:
        self.decider, self.engine, self._owns_engine = decider, engine, owns_engine

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
        model = model_or_embedded(model)
        config = engine_probe_config(str(model), probe_config, engine_kwargs, announce=False)
        decider = Decider(
            config,
            policies,
            on_block=on_block,
            refusal_text=refusal_text,
            metrics=metrics,
            early_block=early_block,
            model_name=model_name,
        )
        _refuse_retries(decider.policies)  # checked before the engine starts
        engine = await AsyncHookedLLM.create(model, config, **engine_kwargs)
        self = cls.__new__(cls)  # the decider is built: only the engine is new
        self._setup(engine, decider, owns_engine=True)
        return self

    @property
    def policies(self) -> tuple[Policy, ...]:
        return self.decider.policies

    @property
    def model_name(self) -> str:
        return self.decider.model_name

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
        ids, errors = ids_for(None if request_id is None else [request_id], 1)
        policy_set = self._policy_set(policies, errors)
        if errors:
            raise errors[0]
        rid = ids[0]
        stop_below, on_error = self.decider.stop_plan(
            self.engine, policy_set, request, sampling_params, False
        )
        chunks = self.engine.stream(
            request,
            sampling_params,
            stop_below=stop_below,
            stop_on_probe_error=on_error,
            probe_key=rid,
        )
        decided = False
        with self.decider.in_flight(1):
            try:
                async for chunk in chunks:
                    if chunk.probe is None:  # a later chunk: the request was allowed
                        yield GuardedStreamChunk(
                            rid,
                            chunk.text,
                            tuple(chunk.token_ids),
                            chunk.finished,
                            chunk.finish_reason,
                            logprobs=chunk.logprobs,
                        )
                        continue
                    verdict = self._decide(rid, chunk, policy_set)
                    decided = True
                    if verdict.blocked:
                        await chunks.aclose()  # aborts the request if it still runs
                        if self.decider.on_block == "raise":
                            raise PromptInjectionBlocked(
                                f"request {rid} blocked: {verdict.reason}", verdict
                            )
                        yield GuardedStreamChunk(
                            rid,
                            self.decider.refusal_text,
                            (),
                            True,
                            BLOCKED_FINISH_REASON,
                            verdict,
                        )
                        return
                    yield GuardedStreamChunk(
                        rid,
                        chunk.text,
                        tuple(chunk.token_ids),
                        chunk.finished,
                        chunk.finish_reason,
                        verdict,
                        chunk.logprobs,
                    )
            except EngineDeadError as exc:
                if not decided:  # no verdict yet: fail closed and record it (once per request)
                    self.decider.observe(self.decider.lost(exc, ids, {}))
                raise
            finally:
                await chunks.aclose()

    def _policy_set(
        self, policies: Sequence[PolicyLike] | None, errors: dict[int, GuardrailError]
    ) -> tuple[Policy, ...]:
        sets = self.decider.policy_sets(
            None if policies is None else [policies], 1, errors, _refuse_retries
        )
        return sets[0]

    def _decide(
        self, request_id: str, chunk: GuardedChunk, policies: tuple[Policy, ...]
    ) -> Verdict:
        """The verdict of a request from its first chunk, recorded in the metrics."""
        output = GuardedOutput(
            index=0,
            prompt=chunk.prompt,
            token_ids=list(chunk.token_ids),
            num_cached_tokens=chunk.num_cached_tokens,
            probe=chunk.probe,
        )
        verdict = self.decider.verdict(request_id, output, policies)
        if verdict is None:  # the first chunk always has a prompt and a probe result
            raise GuardrailError(f"request {request_id}: the engine returned no score")
        self.decider.observe([GuardedResult(index=0, request_id=request_id, verdict=verdict)])
        return verdict

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
        n = check_requests(requests)
        ids, errors = ids_for(request_ids, n)
        sets = self.decider.policy_sets(policies, n, errors, _refuse_retries)
        params = _per_request_params(sampling_params, n)
        send = [i for i in range(n) if i not in errors]
        plans = [
            self.decider.stop_plan(self.engine, sets[i], requests[i], params[i], False)
            for i in send
        ]
        try:
            with self.decider.in_flight(len(send)):
                outputs = await self.engine.generate(
                    [requests[i] for i in send],
                    None if sampling_params is None else [params[i] for i in send],
                    stop_below=[p[0] for p in plans],
                    stop_on_probe_error=[p[1] for p in plans],
                    probe_keys=[ids[i] for i in send],
                )
        except EngineDeadError as exc:
            exc.results = self.decider.lost(exc, ids, errors)
            self.decider.observe(exc.results)
            raise
        results: list[GuardedResult | None] = [None] * n
        for i, error in errors.items():
            results[i] = GuardedResult(index=i, request_id=ids[i], error=error)
        for i, output in zip(send, outputs, strict=True):
            results[i] = self.decider.result(i, ids[i], output, sets[i], False)
        done = [r for r in results if r is not None]
        self.decider.observe(done)
        blocked = [r.verdict for r in done if r.verdict is not None and r.verdict.blocked]
        if blocked and self.decider.on_block == "raise":
            error = PromptInjectionBlocked(
                f"{len(blocked)} of {n} request(s) blocked; first: request "
                f"{blocked[0].request_id}: {blocked[0].reason}",
                blocked[0],
            )
            error.results = done
            raise error
        return done

    def close(self) -> None:
        """Shut the engine down if this guard started it (a shared engine is left running)."""
        if self._owns_engine:
            self.engine.close()

    async def __aenter__(self) -> AsyncGuardedLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


def _per_request_params(sampling_params: Any, n: int) -> list[Any]:
    """One params entry per request (None: the engine's defaults); a None inside a list is
    left to the engine, which fails that request alone."""
    if sampling_params is None or not isinstance(sampling_params, Sequence):
        return [sampling_params] * n
    if len(sampling_params) != n:
        raise ConfigError(
            f"sampling params must be one value, or a list with one per request: {n} requests"
        )
    return list(sampling_params)
