"""``Decider``: the engine-independent half of a guard, shared by ``GuardedLLM`` (sync) and
``AsyncGuardedLLM``: the policies, each request's in-engine stop plan, the verdict and result of
an engine output, and what the metrics observe. It never calls an engine.

Example:
    >>> from guardrail.probe.config import ModelProbeConfig
    >>> config = ModelProbeConfig(model_id="m", heads=[(0, 0)], threshold=0.3)
    >>> decider = Decider(config, [{"threshold": 0.3}], GuardSettings(on_block="raise"))
    >>> [p.kind for p in decider.policies], decider.model_name, decider.settings.on_block
    (['prompt_injection'], 'm', 'raise')
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, Protocol

from guardrail.engine.types import GuardedOutput, PositionLogprobs
from guardrail.errors import (
    ConfigError,
    EngineDeadError,
    EngineNotGuardableError,
    GuardrailError,
    RequestError,
)
from guardrail.guard.settings import DEFAULT_REFUSAL, GuardSettings, OnBlock, VerdictObserver
from guardrail.policy.decide import decide, early_stop
from guardrail.policy.kinds import (
    DEFAULT_POLICY,
    ModelThresholds,
    PerRequestPolicies,
    Policy,
    PolicyLike,
    load_policies,
    policies_per_request,
)
from guardrail.policy.reading import Reading
from guardrail.policy.verdict import Action, FailureMode, Verdict
from guardrail.probe.config import ModelProbeConfig
from guardrail.probe.prompts import RequestLike, request_segments
from guardrail.protocol import ModelInfo, ProbeErrorReason

__all__ = [
    "BLOCKED_FINISH_REASON",
    "DEFAULT_REFUSAL",
    "Decider",
    "GuardSettings",
    "GuardedResult",
    "OnBlock",
    "VerdictObserver",
    "check_requests",
    "request_ids",
]

BLOCKED_FINISH_REASON = "blocked"


class StopFacts(Protocol):
    """What a stop plan needs to know of the engine (``GuardEngine`` and the async engine)."""

    model_info: ModelInfo

    @property
    def stop_token(self) -> int | None: ...


@dataclass(frozen=True)
class GuardedResult:
    """One request's outcome: the text to show and the verdict behind it.

    A blocked request's ``text`` is the refusal and its generated tokens are withheld
    (``token_ids`` empty, ``logprobs`` None) while ``num_generated_tokens`` still counts what
    the engine decoded. ``logprobs``: one entry per token id, when the sampling params asked.
    ``error`` is set (and ``verdict`` is None) when the request itself was invalid. When the
    engine died under the batch (``EngineDeadError``, whose ``results`` hold these), a request
    that could not be answered has both: the engine's error and a fail-closed block verdict,
    and no text.
    """

    index: int
    request_id: str
    text: str = ""
    verdict: Verdict | None = None
    token_ids: tuple[int, ...] = ()
    num_generated_tokens: int = 0
    finish_reason: str | None = None
    error: GuardrailError | None = None
    logprobs: tuple[PositionLogprobs, ...] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def blocked(self) -> bool:
        return self.verdict is not None and self.verdict.blocked

    @property
    def flagged(self) -> bool:
        return self.verdict is not None and self.verdict.flagged


def check_requests(requests: Sequence[RequestLike]) -> int:
    """The number of requests; refuses a single request or a single chat passed as the list."""
    if isinstance(requests, str | tuple) or not isinstance(requests, Sequence):
        raise ConfigError("requests must be a list of requests; wrap a single one in a list")
    if requests and all(isinstance(r, Mapping) and "role" in r for r in requests):
        raise ConfigError(
            "requests looks like one chat (a list of messages); pass a list of "
            "chats: [[{'role': ...}, ...]]"
        )
    return len(requests)


def request_ids(
    given: Sequence[str | None] | None, n: int
) -> tuple[list[str], dict[int, GuardrailError]]:
    """One id per request (None: a fresh uuid4 hex). A bad or repeated id fails its request."""
    if given is None:
        return [uuid.uuid4().hex for _ in range(n)], {}
    if isinstance(given, str) or len(given) != n:
        raise ConfigError(
            f"request_ids must be a list with one id (or None) per request: {n} requests"
        )
    ids: list[str] = []
    errors: dict[int, GuardrailError] = {}
    for i, one in enumerate(given):
        if one is not None and (not isinstance(one, str) or not one):
            errors[i] = RequestError(f"request id {one!r} must be a non-empty string")
        elif one is not None and one in ids:
            errors[i] = RequestError(
                f"request id {one!r} is used twice in this call; request ids must be unique"
            )
        # A failed request is not sent, so a repeated id is kept only to report it.
        ids.append(one if isinstance(one, str) and one else uuid.uuid4().hex)
    return ids, errors


class Decider:
    """A guard's policies and everything decided from them (see the module docstring).

    ``policies`` as ``GuardedLLM`` takes them (default: block prompt injections at the model's
    threshold); they are checked here, before any engine starts.
    """

    def __init__(
        self,
        config: ModelProbeConfig,
        policies: Sequence[PolicyLike] | None = None,
        settings: GuardSettings | None = None,
    ) -> None:
        self.config = config
        self.threshold = config.threshold
        self.thresholds = ModelThresholds.of(config)  # what policies resolve theirs against
        self.policies: tuple[Policy, ...] = load_policies(
            policies if policies is not None else [DEFAULT_POLICY], self.thresholds
        )
        self.settings = settings = settings if settings is not None else GuardSettings()
        self.model_name = settings.model_name or config.model_id

    def announce(self) -> None:
        """Tell the metrics observer (if it asks) the policies' thresholds and whether the model
        config was calibrated: once, when a guard is built (``VerdictObserver``)."""
        metrics = self.settings.metrics
        export = getattr(metrics, "set_thresholds", None)
        if callable(export):  # threshold gauges and zeroed decision series, from the start
            export(self.policies, self.model_name, model_threshold=self.thresholds)
        calibrated = getattr(metrics, "set_calibrated", None)
        if callable(calibrated):
            calibrated(self.config.uncalibrated is None, self.model_name)

    def policy_sets(
        self,
        policies: PerRequestPolicies,
        n: int,
        errors: dict[int, GuardrailError],
        prepare: Callable[[Sequence[Policy]], None] | None,
    ) -> list[tuple[Policy, ...]]:
        """Each request's policies (overrides resolved); ``prepare`` readies retry policies
        (loads their vectors). A bad override fails its own request (``errors``)."""
        sets: list[tuple[Policy, ...]] = []
        for i, entry in enumerate(
            policies_per_request(policies, n, self.policies, self.thresholds)
        ):
            try:
                if not isinstance(entry, ConfigError) and prepare is not None:
                    prepare(entry)
            except (ConfigError, EngineNotGuardableError) as exc:
                entry = ConfigError(f"retry_with_steering cannot run: {exc}")
            if isinstance(entry, ConfigError):
                errors.setdefault(i, entry)
            sets.append(() if isinstance(entry, ConfigError) else entry)
        return sets

    def stop_plan(
        self,
        engine: StopFacts,
        policies: tuple[Policy, ...],
        request: RequestLike,
        params: Any,
        scoring: bool,
        attempt: int = 1,
    ) -> tuple[float | None, bool]:
        """``(stop_below, stop_on_probe_error)`` when this request can be blocked in-engine."""
        if scoring or not self.settings.early_block or not policies:
            return None, False
        # The in-engine stop ends a request with its eos token: it cannot honour min_tokens or
        # ignore_eos, nor decide before the last pipeline stage scored. Such requests are
        # blocked after generation instead (their text is still never delivered).
        if (
            engine.model_info["pp_size"] != 1
            or bool(getattr(params, "min_tokens", 0))
            or getattr(params, "ignore_eos", False)
        ):
            return None, False
        if engine.stop_token is None:
            return None, False
        return early_stop(policies, self.thresholds, attempt, request_segments(request))

    def verdict(
        self,
        request_id: str,
        output: GuardedOutput,
        policies: tuple[Policy, ...],
        verdict: Verdict | None = None,
    ) -> Verdict | None:
        """The verdict on one engine output (None when the output has no result);
        ``verdict`` replaces the policies' decision (retries)."""
        if output.error is not None or output.probe is None or output.prompt is None:
            return None
        probe, prompt = output.probe, output.prompt
        if verdict is None:
            reading = Reading(
                signals=probe.signals,
                error=probe.error,
                error_reason=probe.error_reason,
                head_scores=probe.head_scores,
                segments=prompt.segments,
                instruction_spans=prompt.instruction_spans,
                data_spans=prompt.data_spans,
                num_prompt_tokens=probe.num_prompt_tokens or len(prompt.token_ids),
                latency_s=probe.probe_seconds,
                stopped_early=probe.stopped,
            )
            verdict = decide(
                policies, reading, request_id=request_id, model_threshold=self.thresholds
            )
        notes = {
            "beyond_calibration": self._beyond_calibration(prompt.num_data_tokens, verdict),
            "uncalibrated": self.config.uncalibrated,
        }
        if any(notes.values()):
            verdict = verdict.model_copy(update={k: v for k, v in notes.items() if v})
        return verdict

    def result(
        self,
        index: int,
        request_id: str,
        output: GuardedOutput,
        policies: tuple[Policy, ...],
        scoring: bool,
        verdict: Verdict | None = None,
    ) -> GuardedResult:
        """The result of one output; ``verdict`` replaces the policies' decision (retries)."""
        decided = self.verdict(request_id, output, policies, verdict)
        if decided is None:
            error = output.error or RequestError("the engine returned no result for this request")
            return GuardedResult(index=index, request_id=request_id, error=error)
        result = GuardedResult(
            index=index,
            request_id=request_id,
            verdict=decided,
            num_generated_tokens=len(output.token_ids),
            finish_reason=output.finish_reason,
        )
        if scoring:
            return result
        if decided.blocked:  # the generated tokens (if any) are withheld, only counted
            return replace(
                result, text=self.settings.refusal_text, finish_reason=BLOCKED_FINISH_REASON
            )
        return replace(
            result, text=output.text, token_ids=tuple(output.token_ids), logprobs=output.logprobs
        )

    def _beyond_calibration(self, data_tokens: int, verdict: Verdict) -> str | None:
        """Why this scored request lies outside the config's calibration rows, or None."""
        calibration = self.config.calibration
        limit = calibration.max_data_tokens if calibration is not None else None
        if verdict.focus is None or limit is None or data_tokens <= limit:
            return None
        return (
            f"data has {data_tokens} tokens, longer than any calibration row of the model "
            f"config ({limit}): the score is less reliable here (long clean data scores lower); "
            "calibrate or re-threshold on rows this long (guardrail calibrate / threshold)"
        )

    def observe(self, results: Sequence[GuardedResult]) -> None:
        """Record every verdict in the metrics (if any)."""
        metrics = self.settings.metrics
        if metrics is not None:
            for r in results:
                if r.verdict is not None:
                    metrics.observe_verdict(r.verdict, self.model_name)

    def in_flight(self, n: int) -> AbstractContextManager[Any]:
        """Count ``n`` requests as in flight for the ``with`` block (metrics)."""
        metrics = self.settings.metrics
        if metrics is None:
            return contextlib.nullcontext()
        return metrics.track_in_flight(n, model_name=self.model_name)

    @staticmethod
    def lost(
        error: EngineDeadError, ids: Sequence[str], errors: Mapping[int, GuardrailError]
    ) -> list[GuardedResult]:
        """The results when the engine died under a batch: invalid requests keep their own
        error; every other request gets a fail-closed block verdict and the engine's error,
        and no text (whatever it generated before the death is dropped)."""
        results = []
        for i, request_id in enumerate(ids):
            if i in errors:
                results.append(GuardedResult(index=i, request_id=request_id, error=errors[i]))
                continue
            verdict = Verdict(
                request_id=request_id,
                action=Action.BLOCK,
                failure=FailureMode.FAIL_CLOSED,
                probe_error=f"engine: {error}",
                probe_error_reason=ProbeErrorReason.ENGINE,
                reason="the engine died before this request was answered: blocked (fail-closed), "
                "nothing was generated for it",
            )
            results.append(
                GuardedResult(index=i, request_id=request_id, verdict=verdict, error=error)
            )
        return results
