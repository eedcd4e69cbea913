"""The ``retry_with_steering`` loop, an object ``GuardedLLM`` holds and calls.

After the first (unsteered, probed) generation of a call, every request whose verdict says
retry is generated again with its policy's steering vector, for that request only (the other
requests of the batch are not touched, and steered requests never reuse unsteered KV cache).
Each steered attempt is re-scored by the probe and decided by the same policies; a request
leaves the loop when an attempt is no longer a retry, when its steering failed, or when its
policy's attempts are used up (then the policy's fallback applies). The pure decisions are in
``guardrail.policy.retry``; this module runs them against an engine.

Example:
    >>> retry = PromptInjectionPolicy(action="retry_with_steering",
    ...                               retry={"fallback": "flag"})  # doctest: +SKIP
    >>> llm = GuardedLLM(policies=[retry], enforce_eager=True)  # doctest: +SKIP
    >>> result = llm.generate([request])[0]  # doctest: +SKIP
    >>> [a.steered for a in result.verdict.attempts]  # doctest: +SKIP
    [False, True]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from guardrail.engine.types import GuardedOutput, GuardEngine
from guardrail.errors import ConfigError
from guardrail.policy.decide import retry_policy
from guardrail.policy.kinds import Policy, PromptInjectionPolicy
from guardrail.policy.retry import AttemptRecord, attempt_steering, final_verdict
from guardrail.policy.verdict import Action, Verdict
from guardrail.steering import SteeringVector, packaged_steering_vectors
from guardrail.steering.spec import Steering

__all__ = ["RetryLoop", "retry_vector"]

RunAttempt = Callable[[list[int], int, list[Steering]], list[GuardedOutput]]
"""Generate requests ``indices`` as attempt ``attempt`` with one steering each."""
Decide = Callable[[int, GuardedOutput, Verdict | None], Verdict | None]
"""The verdict of request ``i``'s output (``verdict`` given: record that one instead)."""


def retry_vector(engine: GuardEngine, given: str | None, model_id: str) -> SteeringVector:
    """The vector a retry policy uses, loaded in ``engine``: ``given`` (a loaded or shipped
    vector's name, or a file path), else the vector shipped for the model. Loading fails
    loudly on an engine that cannot steer (compiled mode).

    Example:
        >>> vec = retry_vector(engine, None, "org/SmolLM2-135M-Instruct")  # doctest: +SKIP
        >>> vec.name  # doctest: +SKIP
        'SmolLM2-135M-Instruct'
    """
    name = given or model_id.split("/")[-1]
    if name in engine.steering_vectors:
        return engine.steering_vectors[name]
    if given is None and name not in packaged_steering_vectors():
        raise ConfigError(
            f"retry_with_steering needs a steering vector and none ships for {model_id!r}: "
            "set retry.vector on the policy, or build one with `guardrail steer build`"
        )
    return engine.load_steering_vector(name)


@dataclass
class _Pending:
    policy: PromptInjectionPolicy
    history: list[AttemptRecord]


class RetryLoop:
    """Retries of one guard: the vectors its retry policies use, and the loop itself."""

    def __init__(self, engine: GuardEngine, model_id: str) -> None:
        self.engine = engine
        self.model_id = model_id
        self.vectors: dict[str | None, SteeringVector] = {}

    def prepare(self, policies: Sequence[Policy]) -> None:
        """Load the vectors of enforced retry policies into the engine (loudly refused on an
        engine that cannot steer: a retry must never run unsteered)."""
        for policy in policies:
            if policy.action is not Action.RETRY_WITH_STEERING or policy.shadow:
                continue
            given = policy.retry.vector  # type: ignore[union-attr]  # only this kind retries
            if given not in self.vectors:
                self.vectors[given] = retry_vector(self.engine, given, self.model_id)

    def steering(self, policy: PromptInjectionPolicy, attempt: int) -> Steering:
        vector = self.vectors[policy.retry.vector]
        return attempt_steering(policy.retry, attempt, vector.name, vector.metadata.coefficient)

    def run(
        self,
        verdicts: Sequence[Verdict | None],
        policy_sets: Sequence[Sequence[Policy]],
        run_attempt: RunAttempt,
        decide: Decide,
    ) -> dict[int, tuple[GuardedOutput, Verdict | None]]:
        """Generate again, steered, the requests whose verdict says retry, until each is decided
        or out of attempts. Returns, per retried request, its last output and final verdict."""
        pending: dict[int, _Pending] = {}
        for i, verdict in enumerate(verdicts):
            policy = None if verdict is None else retry_policy(verdict, policy_sets[i])
            if policy is not None and verdict is not None:
                pending[i] = _Pending(policy, [AttemptRecord(verdict)])
        done: dict[int, tuple[GuardedOutput, Verdict | None]] = {}
        attempt = 2
        while pending:
            order = sorted(pending)
            steering = [self.steering(pending[i].policy, attempt) for i in order]
            outputs = run_attempt(order, attempt, steering)
            for i, output, steer in zip(order, outputs, steering, strict=True):
                entry = pending[i]
                settled, verdict = self._record(i, output, steer, entry, decide)
                if settled or attempt >= entry.policy.retry.max_attempts:
                    if not settled:
                        verdict = final_verdict(entry.history, entry.policy.retry)
                    done[i] = (output, verdict)
                    del pending[i]
            attempt += 1
        return done

    @staticmethod
    def _record(
        index: int, output: GuardedOutput, steering: Steering, entry: _Pending, decide: Decide
    ) -> tuple[bool, Verdict | None]:
        """Add one steered attempt to the request's history: (settled, its verdict). Settled
        when the attempt is no longer a retry, its steering failed, or it has no result."""
        verdict = decide(index, output, None)
        if verdict is None:  # the engine returned no result: report that
            return True, None
        report = output.steering
        record = AttemptRecord(
            verdict,
            steering,
            report.tokens_steered if report else 0,
            report.error if report else "the engine returned no steering report",
        )
        entry.history.append(record)
        if verdict.action is Action.RETRY_WITH_STEERING and record.steering_error is None:
            return False, None
        return True, final_verdict(entry.history, entry.policy.retry)
