"""A threshold from the traffic a guard already saw: its score histogram in a metrics scrape.

A guard in shadow mode (or any guard) records every scored request's focus in the
``guardrail_probe_score`` histogram (``guardrail.metrics``), by ``model_name`` and ``signal``.
Where that traffic is clean, the threshold that flags at most a share ``target_fpr`` of it is
read off the histogram: the largest bucket edge at or below which at most that share of the
scores fell. Bucket edges are a fixed grid (``SCORE_BUCKETS``), so the threshold is one of them,
never above the exact quantile (it flags at most ``target_fpr``, maybe less); the edge above
it, and the share it would flag, are reported too.

The histogram cannot tell clean requests from injected ones: scrape a guard whose traffic you
trust (shadow mode on known-good traffic, or a period with no incident), or the injections in
it pull the threshold down. Counters since the guard started: scrape before and after a window
and pass both to count only that window.

Example:
    >>> text = '''guardrail_probe_score_bucket{model_name="m",signal="focus",le="0.1"} 2.0
    ... guardrail_probe_score_bucket{model_name="m",signal="focus",le="0.5"} 10.0
    ... guardrail_probe_score_bucket{model_name="m",signal="focus",le="+Inf"} 200.0
    ... '''
    >>> hist = score_histogram(text, "m")
    >>> hist.total, hist.threshold_at(0.02)
    (200.0, (0.1, 0.01))
"""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from guardrail.errors import ConfigError
from guardrail.probe.config import Calibration, ModelProbeConfig
from guardrail.probe.scoring import FOCUS

__all__ = [
    "MIN_SAMPLES_PER_FLAG",
    "ScoreHistogram",
    "read_scrape",
    "score_histogram",
    "threshold_from_histogram",
]

METRIC = "guardrail_probe_score"
SCRAPE_TIMEOUT_S = 10.0
MIN_SAMPLES_PER_FLAG = 10
"""A target share ``f`` is read reliably from at least ``MIN_SAMPLES_PER_FLAG / f`` scores."""


@dataclass(frozen=True)
class ScoreHistogram:
    """One model's and signal's scores: cumulative counts at each finite bucket edge."""

    model_name: str
    signal: str
    edges: tuple[float, ...]  # finite upper edges, increasing
    cumulative: tuple[float, ...]  # scores at or below each edge
    total: float  # every score (the +Inf bucket)

    def minus(self, earlier: ScoreHistogram) -> ScoreHistogram:
        """The scores recorded between an earlier scrape of the same guard and this one."""
        if earlier.edges != self.edges:
            raise ConfigError("the two scrapes have different bucket edges: not the same guard")
        cumulative = tuple(a - b for a, b in zip(self.cumulative, earlier.cumulative, strict=True))
        total = self.total - earlier.total
        if total < 0 or any(c < 0 for c in cumulative):
            raise ConfigError(
                "the earlier scrape has more scores than the later one (the guard restarted in "
                "between?): scrape twice within one run of the guard"
            )
        return ScoreHistogram(self.model_name, self.signal, self.edges, cumulative, total)

    def threshold_at(self, target_fpr: float) -> tuple[float, float]:
        """(threshold, share of the scores at or below it): the largest bucket edge that flags
        at most ``target_fpr`` of the scores; 0.0 (flags nothing) when even the first edge flags
        more."""
        if self.total <= 0:
            raise ConfigError(f"no {self.signal} scores recorded for model {self.model_name!r}")
        shares = np.asarray(self.cumulative) / self.total
        within = np.flatnonzero(shares <= target_fpr + 1e-12)
        if not within.size:
            return 0.0, 0.0
        k = int(within[-1])
        return self.edges[k], float(shares[k])


def read_scrape(source: str) -> str:
    """A Prometheus text exposition: fetched from an ``http(s)://`` URL (within
    ``SCRAPE_TIMEOUT_S``), or read from a file (a saved scrape)."""
    if source.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(source, timeout=SCRAPE_TIMEOUT_S) as response:
                return str(response.read().decode("utf-8"))
        except OSError as exc:
            raise ConfigError(f"could not scrape {source}: {exc}") from exc
    path = Path(source)
    if not path.is_file():
        raise ConfigError(
            f"no scrape at {source}: give the guard's metrics URL (http://HOST:PORT/metrics) "
            "or a file holding a saved scrape"
        )
    return path.read_text(encoding="utf-8")


def score_histogram(text: str, model_name: str, signal: str = FOCUS) -> ScoreHistogram:
    """The ``guardrail_probe_score`` histogram of ``model_name`` and ``signal`` in a scrape
    (several series of it, e.g. one per replica, are summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[float, float] = {}
    models: set[str] = set()
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise ConfigError(f"not a Prometheus text exposition: {exc}") from exc
    for family in families:  # with or without its # TYPE line (then a family of its own)
        for sample in family.samples:
            if sample.name != f"{METRIC}_bucket" or sample.labels.get("signal") != signal:
                continue
            models.add(sample.labels.get("model_name", ""))
            if sample.labels.get("model_name") == model_name:
                edge = float(sample.labels["le"])
                counts[edge] = counts.get(edge, 0.0) + float(sample.value)
    if not counts:
        seen = ", ".join(repr(m) for m in sorted(models)) or "none"
        raise ConfigError(
            f"the scrape has no {METRIC} histogram for model_name={model_name!r} and "
            f"signal={signal!r} (models with one: {seen}); pass --model-name as the guard "
            "serves the model"
        )
    edges = sorted(e for e in counts if math.isfinite(e))
    total = counts.get(math.inf, max(counts.values()))
    return ScoreHistogram(
        model_name, signal, tuple(edges), tuple(counts[e] for e in edges), float(total)
    )


def threshold_from_histogram(
    config: ModelProbeConfig, histogram: ScoreHistogram, target_fpr: float, source: str
) -> tuple[ModelProbeConfig, dict[str, float]]:
    """``config`` with its threshold set from the scores of a guard's traffic (heads and
    weights kept), and what was read: {"threshold", "flagged_after" (the share of the scores
    at or below it), "next_edge" and "flagged_next" (the bucket edge above and its share),
    "samples"}. The calibration record says where the threshold came from."""
    if not 0.0 < target_fpr < 1.0:
        raise ConfigError(f"--target-fpr must be in (0, 1), got {target_fpr}")
    threshold, flagged = histogram.threshold_at(target_fpr)
    above = [k for k, edge in enumerate(histogram.edges) if edge > threshold]
    if above:
        next_edge = histogram.edges[above[0]]
        flagged_next = histogram.cumulative[above[0]] / histogram.total
    else:  # only +Inf above: it flags everything
        next_edge, flagged_next = 1.0, 1.0
    calibration = config.calibration or Calibration(dataset="", num_examples=0, sha256="")
    note = (
        f"threshold set to {threshold:g} (was {config.threshold}) from the "
        f"{histogram.signal} histogram of {histogram.total:.0f} scored requests of "
        f"{histogram.model_name!r} in {source}: it flags {flagged:.2%} of them "
        f"(target {target_fpr:g}; histogram bucket edges, never above the exact quantile)"
    )
    new_calibration = calibration.model_copy(
        update={
            "thresholds": {**calibration.thresholds, f"traffic fpr@{target_fpr:g}": threshold},
            "notes": f"{calibration.notes}; {note}" if calibration.notes else note,
        }
    )
    new = config.model_copy(update={"threshold": threshold, "calibration": new_calibration})
    info = {
        "threshold": threshold,
        "flagged_after": flagged,
        "next_edge": next_edge,
        "flagged_next": float(flagged_next),
        "samples": histogram.total,
    }
    return ModelProbeConfig.model_validate(new.model_dump()), info
