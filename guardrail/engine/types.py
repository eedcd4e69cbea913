"""What an engine returns, and the engine protocol the guard is written against.

``GuardEngine`` is the interface ``GuardedLLM`` uses: ``HookedLLM`` implements it on vLLM, and
``guardrail.testing.FakeEngine`` implements it without a model for tests of the layers above.

Example:
    >>> ProbeResult(focus=0.8).signals
    {'focus': 0.8}
    >>> failed = ProbeResult(None, error="no score", error_reason=ProbeErrorReason.MISSING)
    >>> failed.signals, str(failed.error_reason)
    ({}, 'missing')
"""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from guardrail.errors import ConfigError, GuardrailError, RequestError
from guardrail.probe.config import ModelProbeConfig
from guardrail.probe.prompts import PreparedPrompt, RequestLike
from guardrail.probe.scoring import FOCUS, HeadKey
from guardrail.protocol import ModelInfo, ProbeErrorReason
from guardrail.steering import SteeringVector
from guardrail.steering.spec import SteeringLike, SteeringReport

__all__ = [
    "FOCUS",
    "STOP_IS",
    "GuardEngine",
    "GuardedChunk",
    "GuardedOutput",
    "HeadScores",
    "HeadStats",
    "PositionLogprobs",
    "ProbeResult",
    "TokenLogprob",
    "is_stop_value",
    "logprobs_of",
    "per_request",
    "per_request_checked",
]


_V = TypeVar("_V")


class _HeadRows(Mapping[HeadKey, _V], Generic[_V]):
    """Per-head values of one request, kept as the array they arrived in and turned into
    Python values only for the heads read (a batch of 64 requests of 128 heads each spent
    milliseconds building dicts nobody read). Compares equal to the dict it stands for."""

    def __init__(self, index: Mapping[HeadKey, int], values: np.ndarray) -> None:
        self._index = index  # head -> its row of ``values`` (shared by every request of a pop)
        self._values = values

    def __getitem__(self, head: HeadKey) -> _V:
        return self._item(self._values[self._index[head]])

    def __iter__(self) -> Any:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self.items())!r})"

    def _item(self, row: np.ndarray) -> _V:
        raise NotImplementedError


class HeadStats(_HeadRows[tuple[float, ...]]):
    """``ProbeResult.head_stats``: each head's ``ATTENTION_STATS``, a tuple of floats.

    Example:
        >>> stats = HeadStats({(0, 1): 0}, np.array([[0.5, 0.25, 0.25, 0.0, 1.0]]))
        >>> stats[(0, 1)], stats == {(0, 1): (0.5, 0.25, 0.25, 0.0, 1.0)}
        ((0.5, 0.25, 0.25, 0.0, 1.0), True)
    """

    def _item(self, row: np.ndarray) -> tuple[float, ...]:
        return tuple(row.tolist())


class HeadScores(_HeadRows[float]):
    """``ProbeResult.head_scores``: each head's focus, a float."""

    def _item(self, row: np.ndarray) -> float:
        return float(row)


@dataclass(frozen=True)
class ProbeResult:
    """What the probe measured for one request (``error`` set when it could not score, and
    ``error_reason`` its category: what code and metrics read, never the message)."""

    focus: float | None
    head_scores: Mapping[HeadKey, float] = field(default_factory=dict)  # focus per head
    head_stats: Mapping[HeadKey, tuple[float, ...]] = field(default_factory=dict)  # ATTENTION_STATS
    # The hidden-state signal: each read layer's term of the probe's logit (config.hidden), and
    # the raw residual stream at the last prompt token / averaged over the data tokens where
    # asked for (calibration).
    hidden: dict[int, float] = field(default_factory=dict)
    hidden_states: dict[int, tuple[float, ...]] = field(default_factory=dict)
    data_mean_states: dict[int, tuple[float, ...]] = field(default_factory=dict)
    # calibration: the whole streams at the prompt positions asked for (``stream_positions``),
    # per layer whose whole streams the engine keeps: ``[positions, hidden_size]`` float32
    token_states: dict[int, np.ndarray] = field(default_factory=dict)
    error: str | None = None
    error_reason: ProbeErrorReason | None = None  # set with ``error``
    num_prompt_tokens: int = 0
    probe_seconds: float = 0.0
    stopped: bool = False  # ended right after prefill by ``stop_below``

    @property
    def signals(self) -> dict[str, float]:
        """Every score the probe produced, by signal name (empty when it could not score)."""
        return {} if self.focus is None else {FOCUS: self.focus}


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability at a generated position, as vLLM computed it
    (``SamplingParams(logprobs=N)``): ``rank`` in the vocabulary (1: the most likely) and
    ``token``, the token's own text (vLLM's ``decoded_token``; None without a tokenizer)."""

    token_id: int
    logprob: float
    rank: int | None = None
    token: str | None = None


PositionLogprobs = tuple[TokenLogprob, ...]
"""The tokens vLLM returned at one generated position: the generated token's first, then the N
most likely (``SamplingParams(logprobs=N)``) by rank; a token that is both appears once."""


def logprobs_of(completion: Any) -> tuple[PositionLogprobs, ...] | None:
    """The logprobs of a vLLM ``CompletionOutput``, one entry per token of its ``token_ids``
    (None when its request asked for none).

    Example:
        >>> from types import SimpleNamespace as Logprob  # vllm.logprobs.Logprob's fields
        >>> entry = Logprob(logprob=-0.1, rank=1, decoded_token="hi")
        >>> out = Logprob(logprobs=[{7: entry}])
        >>> logprobs_of(out)
        ((TokenLogprob(token_id=7, logprob=-0.1, rank=1, token='hi'),),)
        >>> logprobs_of(Logprob(logprobs=None)) is None
        True
    """
    positions = getattr(completion, "logprobs", None)
    if positions is None:
        return None
    return tuple(
        tuple(
            TokenLogprob(int(token_id), float(entry.logprob), entry.rank, entry.decoded_token)
            for token_id, entry in (position or {}).items()
        )
        for position in positions
    )


@dataclass(frozen=True)
class GuardedOutput:
    """One request's result: its prompt and spans (for audit), the text, and the probe result.

    ``error`` is set (and ``probe`` is None) when the request itself was invalid; it was then not
    sent to the engine, and the other requests of the batch were answered normally.
    """

    index: int
    prompt: PreparedPrompt | None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    probe: ProbeResult | None = None
    error: GuardrailError | None = None
    steering: SteeringReport | None = None  # set for steered requests
    logprobs: tuple[PositionLogprobs, ...] | None = None  # one per token id, when asked for


@dataclass(frozen=True)
class GuardedChunk:
    """One step of a streamed request (``AsyncHookedLLM.stream``): the text and token ids new
    since the previous chunk. The first chunk also carries the rendered ``prompt``, the
    ``probe`` result and ``num_cached_tokens``; later chunks have them None (0). ``logprobs``:
    one entry per token id of the chunk, when the sampling params asked for them."""

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    prompt: PreparedPrompt | None = None
    probe: ProbeResult | None = None
    num_cached_tokens: int = 0
    logprobs: tuple[PositionLogprobs, ...] | None = None

    def first(self, prompt: PreparedPrompt, probe: ProbeResult, cached: int) -> GuardedChunk:
        """This chunk as a request's first: with its prompt, probe result and cached tokens."""
        return replace(self, prompt=prompt, probe=probe, num_cached_tokens=cached)


class GuardEngine(Protocol):
    """The engine interface the guard layer uses (``HookedLLM``, ``FakeEngine``).

    ``generate`` may be called from several threads (``HookedLLM`` serialises the calls), and
    raises ``guardrail.errors.EngineDeadError`` when the engine can no longer answer; the guard
    then fails the batch closed (docs/reliability.md).
    """

    config: ModelProbeConfig
    model_info: ModelInfo

    @property
    def stop_token(self) -> int | None:
        """The token an early-stopped request ends with (None: no early stops)."""
        ...

    @property
    def steering_vectors(self) -> Mapping[str, SteeringVector]: ...

    def load_steering_vector(self, vector: str | Path | SteeringVector) -> SteeringVector: ...

    def generate(
        self,
        requests: Sequence[RequestLike],
        sampling_params: Any | Sequence[Any] | None = None,
        *,
        stop_below: float | Sequence[float | None] | None = None,
        stop_on_probe_error: bool | Sequence[bool] = True,
        probe_keys: Sequence[str | None] | None = None,
        steering: SteeringLike | Sequence[SteeringLike | None] | None = None,
    ) -> list[GuardedOutput]: ...

    def close(self) -> None: ...


def per_request(value: Any, n: int, name: str) -> list[Any]:
    """``value`` once per request: a sequence (not a string) must have one entry per request.

    Example:
        >>> per_request(0.5, 2, "stop_below"), per_request([1, 2], 2, "stop_below")
        ([0.5, 0.5], [1, 2])
        >>> per_request([1], 2, "stop_below")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        guardrail.errors.ConfigError: got 1 values of stop_below for 2 requests; pass one, ...
    """
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n:
            raise ConfigError(
                f"got {len(value)} values of {name} for {n} requests; pass one, or one per request"
            )
        return list(value)
    return [value] * n


def per_request_checked(
    value: Any,
    n: int,
    name: str,
    valid: Callable[[Any], bool],
    expected: str,
    errors: dict[int, GuardrailError],
) -> list[Any]:
    """``per_request`` with every value checked by ``valid``.

    One value for every request that is invalid raises ``ConfigError`` (the call is wrong). An
    invalid entry of a list fails its own request alone: ``errors[index]`` gets a
    ``RequestError`` naming the index and what to pass (unless that request already failed),
    and None takes its place.

    Example:
        >>> finite = lambda v: v is None or isinstance(v, float)
        >>> errors = {}
        >>> per_request_checked([0.5, "x"], 2, "stop_below", finite, "a float", errors)
        [0.5, None]
        >>> errors
        {1: RequestError("request 1: stop_below must be a float, got str 'x'")}
        >>> per_request_checked("x", 2, "stop_below", finite, "a float", {})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        guardrail.errors.ConfigError: stop_below must be a float (or a list with one per ...
    """
    values = per_request(value, n, name)
    if not (isinstance(value, Sequence) and not isinstance(value, str)):
        if n and not valid(value):
            raise ConfigError(
                f"{name} must be {expected} (or a list with one per request), got {_show(value)}"
            )
        return values
    for i, entry in enumerate(values):
        if not valid(entry):
            message = f"request {i}: {name} must be {expected}, got {_show(entry)}"
            errors.setdefault(i, RequestError(message))
            values[i] = None
    return values


STOP_IS = "None or a finite number (end the request after prefill at or below this focus)"
"""What a valid ``stop_below`` value is, for error messages."""


def is_stop_value(value: Any) -> bool:
    """A valid ``stop_below`` entry: None (no early stop) or a finite real number (not a bool).

    Example:
        >>> [is_stop_value(v) for v in (None, 0.3, 1, float("nan"), True, "0.3")]
        [True, True, True, False, False, False]
    """
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    return math.isfinite(float(value))


def _show(value: Any) -> str:
    return f"{type(value).__name__} {reprlib.repr(value)}"
