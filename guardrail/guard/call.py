"""``GuardedCall``: one call of a guard (``generate``, ``score``, one ``stream``), all of it but
the engine call, so the sync ``GuardedLLM`` and the ``AsyncGuardedLLM`` run calls one way.

A call checks its requests, ids and sampling params (a bad entry fails its own request),
resolves each request's policies, plans each request's in-engine stop (``batch``), turns the
engine's outputs into results in request order (``results``), fails every request closed when
the engine died (``fail``), and at the end records the verdicts and, with ``on_block="raise"``,
raises for blocked requests (``finish``). The engine call itself is the guards' own: a call or
an ``await`` of ``batch(...).submit(engine.generate)``.

Example:
    >>> call = GuardedCall(decider, engine, requests, None, None)  # doctest: +SKIP
    >>> call.resolve(None, prepare=None)  # doctest: +SKIP
    >>> results = call.finish(call.results(call.batch(call.send).submit(engine.generate)))
    ... # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from guardrail.engine.types import GuardedOutput, per_request
from guardrail.errors import EngineDeadError, PromptInjectionBlocked, RequestError
from guardrail.guard.decider import (
    Decider,
    GuardedResult,
    StopFacts,
    check_requests,
    request_ids,
)
from guardrail.policy.kinds import PerRequestPolicies, Policy
from guardrail.policy.verdict import Verdict
from guardrail.probe.prompts import RequestLike

__all__ = ["EngineBatch", "GuardedCall", "raise_if_blocked"]

T = TypeVar("T")

_NO_PARAMS = (
    "request {i}: its sampling params are None; pass a vllm.SamplingParams for every request "
    "(or one SamplingParams, or None instead of the list, for all of them)"
)


def raise_if_blocked(results: Sequence[GuardedResult], on_block: str) -> None:
    """With ``on_block="raise"``, raise ``PromptInjectionBlocked`` for the first blocked result;
    the error carries every result (none lost) and the first blocked verdict."""
    blocked = [r.verdict for r in results if r.verdict is not None and r.verdict.blocked]
    if not blocked or on_block != "raise":
        return
    first = blocked[0]
    if len(results) == 1:
        message = f"request {first.request_id} blocked: {first.reason}"
    else:
        message = (
            f"{len(blocked)} of {len(results)} request(s) blocked; first: request "
            f"{first.request_id}: {first.reason}"
        )
    raise PromptInjectionBlocked(message, first, results=list(results))


@dataclass(frozen=True)
class EngineBatch:
    """What one engine call sends, request by request in ``order``: the requests, their sampling
    params (None: the engine's defaults), their in-engine stop plans and their probe keys."""

    order: list[int]
    requests: list[RequestLike]
    params: list[Any] | None
    stop_below: list[float | None]
    stop_on_probe_error: list[bool]
    probe_keys: list[str]

    def submit(self, generate: Callable[..., T], **extra: Any) -> T:
        """``generate(...)`` with this batch (``extra``: e.g. ``steering``); its return value
        as is, an awaitable for the async engine."""
        return generate(
            self.requests,
            self.params,
            stop_below=self.stop_below,
            stop_on_probe_error=self.stop_on_probe_error,
            probe_keys=self.probe_keys,
            **extra,
        )


class GuardedCall:
    """One call's requests, checked (see the module docstring). ``scoring``: probe only, no
    text and never a raise for blocked requests."""

    def __init__(
        self,
        decider: Decider,
        engine: StopFacts,
        requests: Sequence[RequestLike],
        sampling_params: Any,
        given_ids: Sequence[str | None] | None,
        *,
        scoring: bool = False,
    ) -> None:
        n = check_requests(requests)
        self.decider, self.engine, self.requests, self.scoring = decider, engine, requests, scoring
        self.params = per_request(sampling_params, n, "sampling params")
        self.engine_defaults = sampling_params is None
        self.ids, self.errors = request_ids(given_ids, n)
        if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            for i, given in enumerate(self.params):
                if given is None:
                    self.errors.setdefault(i, RequestError(_NO_PARAMS.format(i=i)))
        self.sets: list[tuple[Policy, ...]] = [() for _ in range(n)]
        self.send: list[int] = []

    def resolve(
        self,
        policies: PerRequestPolicies,
        prepare: Callable[[Sequence[Policy]], None] | None,
    ) -> None:
        """Each request's policies (``Decider.policy_sets``; ``prepare`` may load retry vectors
        into the engine), and so which requests are sent: those without an error."""
        self.sets = self.decider.policy_sets(policies, len(self.requests), self.errors, prepare)
        self.send = [i for i in range(len(self.requests)) if i not in self.errors]

    def batch(self, order: Sequence[int], attempt: int = 1) -> EngineBatch:
        """The engine call for the requests ``order`` on their ``attempt``-th generation (a
        retry's probe key names its attempt, so its score never meets an earlier one)."""
        plans = [
            self.decider.stop_plan(
                self.engine, self.sets[i], self.requests[i], self.params[i], self.scoring, attempt
            )
            for i in order
        ]
        return EngineBatch(
            order=list(order),
            requests=[self.requests[i] for i in order],
            params=None if self.engine_defaults else [self.params[i] for i in order],
            stop_below=[stop for stop, _ in plans],
            stop_on_probe_error=[on_error for _, on_error in plans],
            probe_keys=[
                self.ids[i] if attempt == 1 else f"{self.ids[i]}~attempt{attempt}" for i in order
            ],
        )

    def result(
        self, i: int, output: GuardedOutput, verdict: Verdict | None = None
    ) -> GuardedResult:
        """Request ``i``'s result from its output; ``verdict`` replaces the policies' (retries)."""
        return self.decider.result(i, self.ids[i], output, self.sets[i], self.scoring, verdict)

    def results(self, outputs: Sequence[GuardedOutput]) -> list[GuardedResult]:
        """Every request's result, in order: the outputs of the sent requests (``send``, in
        that order), the errors of the others."""
        by_index = dict(zip(self.send, outputs, strict=True))
        return [
            self.result(i, by_index[i])
            if i in by_index
            else GuardedResult(index=i, request_id=self.ids[i], error=self.errors[i])
            for i in range(len(self.requests))
        ]

    def fail(self, error: EngineDeadError) -> None:
        """The engine died under this call: every unanswered request fails closed, recorded;
        ``error.results`` holds them all (``Decider.lost``)."""
        error.results = self.decider.lost(error, self.ids, self.errors)
        self.decider.observe(error.results)

    def finish(self, results: list[GuardedResult]) -> list[GuardedResult]:
        """Record the verdicts; then, unless scoring, ``raise_if_blocked``."""
        self.decider.observe(results)
        if not self.scoring:
            raise_if_blocked(results, self.decider.settings.on_block)
        return results
