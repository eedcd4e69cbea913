"""Prometheus metrics: the recorder (``GuardrailMetrics``) and their exposition over HTTP.

Example:
    >>> from prometheus_client import CollectorRegistry
    >>> from guardrail.metrics import GuardrailMetrics
    >>> metrics = GuardrailMetrics(CollectorRegistry(), model_name="m")
"""

from guardrail.metrics.http import (
    MetricsServer,
    make_asgi_app,
    mark_process_dead,
    multiprocess_dir,
    multiprocess_registry,
    scrape_registry,
    start_metrics_server,
)
from guardrail.metrics.recorder import (
    DISTRIBUTION,
    INITIAL_SIGNALS,
    NAMESPACE,
    PROBE_DURATION_BUCKETS,
    PROBE_ERROR_REASONS,
    SCORE_BUCKETS,
    GuardrailMetrics,
)

__all__ = [
    "DISTRIBUTION",
    "INITIAL_SIGNALS",
    "NAMESPACE",
    "PROBE_DURATION_BUCKETS",
    "PROBE_ERROR_REASONS",
    "SCORE_BUCKETS",
    "GuardrailMetrics",
    "MetricsServer",
    "make_asgi_app",
    "mark_process_dead",
    "multiprocess_dir",
    "multiprocess_registry",
    "scrape_registry",
    "start_metrics_server",
]
