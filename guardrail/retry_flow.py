"""The ``retry_with_steering`` flow of ``GuardedLLM`` (mixed in; see ``guardrail.retry``).

After the first (unsteered, probed) generation of a call, every request whose verdict says
retry is generated again with its policy's steering vector, for that request only (the other
requests of the batch are not touched, and steered requests never reuse unsteered KV cache).
Each steered attempt is re-scored by the probe and decided by the same policies; a request
leaves the loop when an attempt is no longer a retry, when its steering failed, or when its
policy's attempts are used up (then the policy's fallback applies). A steered attempt is
stopped after prefill when its outcome will be discarded (``policy.early_stop``).

Example:
    >>> retry = PromptInjectionPolicy(action="retry_with_steering",
    ...                               retry={"fallback": "flag"})  # doctest: +SKIP
    >>> llm = GuardedLLM(policies=[retry], enforce_eager=True)  # doctest: +SKIP
    >>> result = llm.generate([request])[0]  # doctest: +SKIP
    >>> [a.steered for a in result.verdict.attempts]  # doctest: +SKIP
    [False, True]
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from guardrail.config import ModelProbeConfig
from guardrail.policy import Policy
from guardrail.prompts import RequestLike
from guardrail.retry import (
    AttemptRecord,
    attempt_steering,
    final_verdict,
    retry_policy,
    retry_vector,
)
from guardrail.steering import SteeringVector
from guardrail.steering_engine import Steering
from guardrail.verdict import Action, Verdict

if TYPE_CHECKING:
    from guardrail.engine import GuardedOutput
    from guardrail.guarded import GuardedResult

_Pending = dict[int, tuple[Policy, list[AttemptRecord]]]


class RetryFlowMixin:
    """Retries of ``GuardedLLM``; uses its engine, config, stop plans and result building."""

    engine: Any
    config: ModelProbeConfig
    _retry_vectors: dict[str | None, SteeringVector]

    def _stop_plan(
        self, policies: tuple[Policy, ...], params: Any, scoring: bool, attempt: int = 1
    ) -> tuple[float | None, bool]:
        raise NotImplementedError  # provided by GuardedLLM

    def _result(
        self,
        index: int,
        request_id: str,
        output: GuardedOutput,
        policies: tuple[Policy, ...],
        scoring: bool,
        verdict: Verdict | None = None,
    ) -> GuardedResult:
        raise NotImplementedError  # provided by GuardedLLM

    def _in_flight(self, n: int) -> AbstractContextManager[Any]:
        raise NotImplementedError  # provided by GuardedLLM

    def _prepare_steering(self, policies: Sequence[Policy]) -> None:
        """Load the vectors of enforced retry policies into the engine (loudly refused on an
        engine that cannot steer: a retry must never run unsteered)."""
        for policy in policies:
            given = policy.retry.vector
            enforced_retry = policy.action is Action.RETRY_WITH_STEERING and not policy.shadow
            if enforced_retry and given not in self._retry_vectors:
                self._retry_vectors[given] = retry_vector(self.engine, given, self.config.model_id)

    def _retry(
        self,
        requests: Sequence[RequestLike],
        sampling_params: Any,
        params: list[Any],
        sets: list[tuple[Policy, ...]],
        ids: list[str],
        results: list[GuardedResult | None],
    ) -> None:
        """Generate again, steered, the requests whose verdict says retry, until each is
        decided or out of attempts; ``results`` is updated in place."""
        pending: _Pending = {}
        for i, result in enumerate(results):
            verdict = None if result is None else result.verdict
            policy = None if verdict is None else retry_policy(verdict, sets[i])
            if policy is not None and verdict is not None:
                pending[i] = (policy, [AttemptRecord(verdict)])
        attempt = 2
        while pending:
            order = sorted(pending)
            steering = {i: self._attempt_steering(pending[i][0], attempt) for i in order}
            plans = [self._stop_plan(sets[i], params[i], False, attempt) for i in order]
            with self._in_flight(len(order)):
                outputs = self.engine.generate(
                    [requests[i] for i in order],
                    None if sampling_params is None else [params[i] for i in order],
                    stop_below=[p[0] for p in plans],
                    stop_on_probe_error=[p[1] for p in plans],
                    probe_keys=[f"{ids[i]}~attempt{attempt}" for i in order],
                    steering=[steering[i] for i in order],
                )
            for i, output in zip(order, outputs, strict=True):
                done = self._record_attempt(i, ids[i], output, sets[i], pending, steering[i])
                if done is not None or attempt >= pending[i][0].retry.max_attempts:
                    results[i] = done or self._finish(i, ids[i], output, sets[i], pending[i])
                    del pending[i]
            attempt += 1

    def _attempt_steering(self, policy: Policy, attempt: int) -> Steering:
        vector = self._retry_vectors[policy.retry.vector]
        return attempt_steering(policy.retry, attempt, vector.name, vector.metadata.coefficient)

    def _record_attempt(
        self,
        index: int,
        request_id: str,
        output: GuardedOutput,
        policies: tuple[Policy, ...],
        pending: _Pending,
        steering: Steering,
    ) -> GuardedResult | None:
        """Add one steered attempt to the request's history; its final result when this
        attempt settles it (no longer a retry, steering failed, or no result at all)."""
        result = self._result(index, request_id, output, policies, scoring=False)
        if result.verdict is None:  # the engine returned no result: report that
            return result
        report = output.steering
        record = AttemptRecord(
            result.verdict,
            steering,
            report.tokens_steered if report else 0,
            report.error if report else "the engine returned no steering report",
        )
        history = pending[index][1]
        history.append(record)
        again = record.verdict.action is Action.RETRY_WITH_STEERING
        if again and record.steering_error is None:
            return None
        return self._finish(index, request_id, output, policies, pending[index])

    def _finish(
        self,
        index: int,
        request_id: str,
        output: GuardedOutput,
        policies: tuple[Policy, ...],
        entry: tuple[Policy, list[AttemptRecord]],
    ) -> GuardedResult:
        policy, history = entry
        verdict = final_verdict(history, policy.retry)
        return self._result(index, request_id, output, policies, False, verdict)
