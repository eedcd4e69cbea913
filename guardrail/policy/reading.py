"""``Reading``: everything a policy may decide on for one request.

The probe's signals by name (today ``"focus"``, the attention probe's combined score; a second
detector adds its own name), why the probe could not score if it could not (a message, and its
``ProbeErrorReason``, which is what code reads), and the request's
own content as the caller marked it (trusted instruction text, untrusted data), so a text-only
policy needs no engine at all.

Example:
    >>> from guardrail.probe.prompts import Segment
    >>> r = Reading(signals={"focus": 0.4},
    ...             segments=(Segment(text="Summarize.", kind="instruction"),
    ...                       Segment(text="Hi Bob", kind="data")))
    >>> r.focus, r.data_texts
    (0.4, ('Hi Bob',))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from guardrail.probe.prompts import Segment
from guardrail.probe.scoring import FOCUS
from guardrail.protocol import ProbeErrorReason

__all__ = ["FOCUS", "Reading"]


@dataclass(frozen=True)
class Reading:
    """What is known about one request when policies decide."""

    signals: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None  # why the probe could not score (then ``signals`` is empty)
    error_reason: ProbeErrorReason | None = None  # the category of ``error``
    head_scores: Mapping[tuple[int, int], float] = field(default_factory=dict)
    segments: Sequence[Segment] = ()
    instruction_spans: Sequence[tuple[int, int]] = ()
    data_spans: Sequence[tuple[int, int]] = ()
    num_prompt_tokens: int = 0
    latency_s: float = 0.0
    stopped_early: bool = False

    @property
    def focus(self) -> float | None:
        return self.signals.get(FOCUS)

    @property
    def data_texts(self) -> tuple[str, ...]:
        """The untrusted pieces of the request, in order."""
        return tuple(s.text for s in self.segments if s.kind == "data")

    def failed(self, signal: str = FOCUS) -> str | None:
        """Why ``signal`` has no usable value (None when it has one).

        Example:
            >>> Reading(error="layer 3: boom").failed()
            'layer 3: boom'
            >>> Reading(signals={"focus": float("nan")}).failed()
            'no usable score (focus=nan)'
        """
        if self.error is not None:
            return self.error
        value = self.signals.get(signal)
        if value is None or not math.isfinite(value):
            return f"no usable score ({signal}={value})"
        return None

    def failure_reason(self, signal: str = FOCUS) -> ProbeErrorReason | None:
        """The category of ``failed(signal)``: the error's own ``error_reason``, and ``OTHER``
        for an error without one or a missing or non-finite score (None when it has a value).

        Example:
            >>> Reading(error="boom", error_reason=ProbeErrorReason.LAYER).failure_reason()
            <ProbeErrorReason.LAYER: 'layer'>
            >>> Reading(signals={"focus": float("nan")}).failure_reason()
            <ProbeErrorReason.OTHER: 'other'>
            >>> Reading(signals={"focus": 0.4}).failure_reason() is None
            True
        """
        if self.error is not None:
            return self.error_reason or ProbeErrorReason.OTHER
        return None if self.failed(signal) is None else ProbeErrorReason.OTHER
