"""The caller side of the probe protocol, for any engine front end (sync or async).

An engine renders a request (``guardrail.probe.prompts``), asks the ``ProbeClient`` for the
request's ``ProbeSpec`` and attaches it to the request's ``SamplingParams``; after the request
ran it pops the workers' results by key (``RPC_POP_RESULTS``, one call for a whole batch) and
hands them to ``ProbeClient.result``, which merges tensor-parallel ranks and combines the head
scores into the model config's signals. The client never talks to vLLM itself, so the offline
``HookedLLM`` and an async engine share it unchanged.

Example:
    >>> from guardrail.probe.config import ModelProbeConfig
    >>> client = ProbeClient(ModelProbeConfig(model_id="m", heads=[(0, 0)]), tp_size=1,
    ...                      stop_token=2)
    >>> import numpy as np
    >>> stats = np.array([0.6, 0.2, 0.1, 0.1, 0.5]).tobytes()  # float64, as the worker sends
    >>> rank = {"heads": [[0, 0]], "results": {"k": {"num_prompt_tokens": 5, "probe_seconds": 0.001,
    ...                                             "stats": stats}}}
    >>> round(client.result([rank], "k").focus, 3)
    0.75
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from guardrail.engine.types import (
    STOP_IS,
    HeadScores,
    HeadStats,
    ProbeResult,
    is_stop_value,
    per_request,
    per_request_checked,
)
from guardrail.errors import ConfigError, GuardrailError, RequestError
from guardrail.probe.config import ModelProbeConfig
from guardrail.probe.prompts import PreparedPrompt
from guardrail.probe.scoring import ATTENTION_STATS, HeadKey, focus_of
from guardrail.protocol import PROBE_ARG, PoppedResults, ProbeErrorReason, ProbeSpec

__all__ = [
    "MISSING_SCORE",
    "PerRequestArgs",
    "ProbeClient",
    "checked_probe_keys",
    "checked_request_args",
    "per_request_args",
    "request_count",
]


MISSING_SCORE = "missing: the probe returned no score for this request"
"""The error of a request whose score did not come back (reason ``ProbeErrorReason.MISSING``)."""


def checked_probe_keys(
    probe_keys: Sequence[str | None] | None, n: int, errors: dict[int, GuardrailError]
) -> list[str | None]:
    """One probe key (or None: a fresh one) per request. An entry that is not a non-empty
    string, or repeats an earlier key, fails its own request alone (``errors[index]``, and None
    in its place); anything but a list fails the call.

    Example:
        >>> errors = {}
        >>> checked_probe_keys(["a", None, 3, "a", ""], 5, errors)
        ['a', None, None, None, None]
        >>> sorted(errors)
        [2, 3, 4]
    """
    if probe_keys is not None and (
        isinstance(probe_keys, str) or not isinstance(probe_keys, Sequence)
    ):
        raise ConfigError("probe_keys must be a list with one key (or None) per request")
    keys = per_request(probe_keys, n, "probe_keys")
    seen: set[str] = set()
    for i, key in enumerate(keys):
        problem = None
        if key is None:
            continue
        if not isinstance(key, str) or not key:
            problem = "must be a non-empty string (or None for a fresh key)"
        elif key in seen:
            problem = "is used twice in this call; keys must be distinct"
        if problem is None:
            seen.add(key)
        else:
            errors.setdefault(i, RequestError(f"request {i}: probe key {key!r} {problem}"))
            keys[i] = None
    return keys


@dataclass(frozen=True)
class PerRequestArgs:
    """``generate``'s per-request arguments, one entry per request, checked: an invalid entry
    is in ``errors`` (by request index) and its request is not sent."""

    params: list[Any]
    stop_below: list[Any]
    stop_on_probe_error: list[Any]
    probe_keys: list[str | None]
    errors: dict[int, GuardrailError]


def per_request_args(
    requests: Sequence[Any],
    sampling_params: Any,
    stop_below: Any,
    stop_on_probe_error: Any,
    probe_keys: Sequence[str | None] | None,
    default_params: Callable[[], Any],
) -> PerRequestArgs:
    """Check ``generate``'s arguments the same way for every engine (sync and async): one value
    for all requests or one per request; ``default_params()`` when ``sampling_params`` is None.
    A list of the wrong length (or a single request not in a list) fails the whole call."""
    n = request_count(requests)
    from vllm import SamplingParams

    errors: dict[int, GuardrailError] = {}
    if sampling_params is None:
        params = [default_params()] * n
    else:
        expected = (
            "a vllm.SamplingParams (one for all requests, one per request, or None for the "
            "defaults)"
        )
        valid = lambda p: isinstance(p, SamplingParams)  # noqa: E731
        params = per_request_checked(sampling_params, n, "sampling params", valid, expected, errors)
    stops, on_error, keys = checked_request_args(
        n, stop_below, stop_on_probe_error, probe_keys, errors
    )
    return PerRequestArgs(params, stops, on_error, keys, errors)


def request_count(requests: Sequence[Any]) -> int:
    """How many requests a ``generate`` call has; a single request not in a list fails the call."""
    if isinstance(requests, str | tuple):
        raise ConfigError("generate() takes a list of requests; wrap a single one in a list")
    return len(requests)


def checked_request_args(
    n: int,
    stop_below: Any,
    stop_on_probe_error: Any,
    probe_keys: Sequence[str | None] | None,
    errors: dict[int, GuardrailError],
) -> tuple[list[Any], list[Any], list[str | None]]:
    """The model-free part of ``per_request_args`` for ``n`` requests (``request_count``):
    ``stop_below``, ``stop_on_probe_error`` and ``probe_keys``, checked the same way by every
    engine, ``guardrail.testing.FakeEngine`` included (a bad entry fails its own request in
    ``errors``; a bad single value fails the call)."""
    stops = per_request_checked(stop_below, n, "stop_below", is_stop_value, STOP_IS, errors)
    on_error = per_request_checked(
        stop_on_probe_error,
        n,
        "stop_on_probe_error",
        lambda v: isinstance(v, bool),
        "True or False",
        errors,
    )
    return stops, on_error, checked_probe_keys(probe_keys, n, errors)


class ProbeClient:
    """Builds probe specs and turns the workers' results into ``ProbeResult``s.

    ``tp_size`` is the engine's tensor-parallel size (each rank scores its own heads, and the
    ranks exchange them before deciding early stops); ``stop_token`` the token a stopped request
    is ended with (the tokenizer's eos); ``pp_size`` the pipeline-parallel size (stages score
    their own layers; early stops are refused).
    """

    def __init__(
        self, config: ModelProbeConfig, *, tp_size: int, stop_token: int | None, pp_size: int = 1
    ) -> None:
        self.config = config
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.stop_token = stop_token
        self._config_heads = frozenset(config.heads)
        self._last_order: tuple[list[list[int]], _HeadOrder] | None = None

    def spec(
        self,
        prepared: PreparedPrompt,
        key: str,
        params: Any,
        stop_below: float | None = None,
        stop_on_error: bool = True,
        tag: str | None = None,
        stream_positions: Sequence[int] | None = None,
    ) -> ProbeSpec:
        """The request's spec; with ``stop_below`` it also asks for an early stop. With
        ``tag`` (the call's) its result is pushed to the caller (``guardrail.engine.inbox``);
        with ``stream_positions`` its streams at those prompt positions come back
        (``ProbeResult.token_states``, calibration engines)."""
        spec: ProbeSpec = {
            "key": key,
            "instruction": [list(s) for s in prepared.instruction_spans],
            "data": [list(s) for s in prepared.data_spans],
            "num_prompt_tokens": len(prepared.token_ids),
        }
        if tag is not None:
            spec["tag"] = tag
        if stream_positions is not None:
            spec["stream_positions"] = [int(p) for p in stream_positions]
        if stop_below is None:
            return spec
        if self.pp_size != 1:
            raise ConfigError(
                "early stop (stop_below) needs every layer's heads in one pipeline stage; with "
                "pipeline_parallel_size > 1 requests are scored, and blocked after generation"
            )
        if getattr(params, "min_tokens", 0):
            raise ConfigError("stop_below cannot end a request that sets min_tokens > 0")
        if getattr(params, "ignore_eos", False):
            raise ConfigError(
                "stop_below cannot be combined with ignore_eos=True: a request stopped after "
                "prefill ends on the eos token, so its sampling params make eos a stop token, "
                "which would also end the request at its first natural eos; drop ignore_eos, "
                "or leave stop_below unset and block after generation"
            )
        if self.stop_token is None:
            raise ConfigError("the tokenizer has no eos token to end stopped requests with")
        spec["stop_below"] = float(stop_below)
        spec["stop_on_error"] = bool(stop_on_error)
        spec["stop_token"] = int(self.stop_token)
        return spec

    @staticmethod
    def attach(params: Any, spec: ProbeSpec) -> Any:
        """A copy of ``params`` (vLLM ``SamplingParams``) carrying ``spec``; a stopping spec
        also makes its stop token end the request."""
        params = copy.copy(params)  # shallow: only new objects are assigned below (vLLM clones)
        params.extra_args = {**(params.extra_args or {}), PROBE_ARG: spec}
        stop_token = spec.get("stop_token")
        if stop_token is not None and stop_token not in (params.stop_token_ids or []):
            params.stop_token_ids = [*(params.stop_token_ids or []), stop_token]
        return params

    def result(self, per_rank: Sequence[PoppedResults], key: str) -> ProbeResult:
        """The request's ``ProbeResult`` from every rank's popped results (ranks each score
        their own heads; errors win; missing or incomplete heads are errors)."""
        tables: list[tuple[_HeadOrder, np.ndarray]] = []
        hidden: dict[int, float] = {}
        streams: dict[int, tuple[float, ...]] = {}
        means: dict[int, tuple[float, ...]] = {}
        tokens: dict[int, np.ndarray] = {}
        error: str | None = None
        reason: ProbeErrorReason | None = None
        num_prompt_tokens, seconds, stopped = 0, 0.0, False
        config_stats: np.ndarray | None = None  # the config's heads, from a rank holding all
        for rank in per_rank:
            found = rank["results"].get(key)
            if found is None:
                continue
            if error is None and found.get("error"):  # the first rank's error wins
                error = found["error"]
                reason = ProbeErrorReason(found.get("reason", ProbeErrorReason.OTHER))
            num_prompt_tokens = found["num_prompt_tokens"]
            seconds = max(seconds, found["probe_seconds"])
            stopped = stopped or bool(found.get("stopped"))
            flat = found.get("stats")
            if flat is not None:  # len(ATTENTION_STATS) values per head, in the rank's order
                order = self._order(rank["heads"])
                table = np.frombuffer(flat, dtype=np.float64).reshape(-1, len(ATTENTION_STATS))
                if config_stats is None and order.config_rows is not None:
                    config_stats = table[order.config_rows]
                tables.append((order, table))
            # the stream between layers is the same on every tensor-parallel rank
            hidden.update((int(layer), float(term)) for layer, term in found.get("hidden", []))
            streams.update((int(lay), _floats(x)) for lay, x in found.get("hidden_states", []))
            means.update((int(lay), _floats(x)) for lay, x in found.get("data_mean_states", []))
            for lay, count, x in found.get("token_states", []):
                tokens[int(lay)] = np.frombuffer(x, dtype=np.float32).reshape(int(count), -1)
        heads, scores = _head_tables(tables)
        if error is None and not heads:
            error = MISSING_SCORE
            reason = ProbeErrorReason.MISSING
        elif error is None and config_stats is None and not self._config_heads <= heads.keys():
            error = "incomplete: some configured heads were not scored"
            reason = ProbeErrorReason.INCOMPLETE
        elif error is None and any(lay not in hidden for lay in self.config.hidden_layers):
            error = "incomplete: some configured hidden layers were not read"
            reason = ProbeErrorReason.INCOMPLETE
        focus = None
        if error is None and config_stats is not None:  # from one array: no dict per head
            focus = self.config.focus_of_stats(config_stats, hidden)
        elif error is None:
            focus = self.config.focus(heads, hidden)
        return ProbeResult(
            focus=focus,
            head_scores=scores,
            head_stats=heads,
            hidden=hidden,
            hidden_states=streams,
            data_mean_states=means,
            token_states=tokens,
            error=error,
            error_reason=reason,
            num_prompt_tokens=num_prompt_tokens,
            probe_seconds=seconds,
            stopped=stopped,
        )

    def _order(self, wire: list[list[int]]) -> _HeadOrder:
        """A rank's head order as sent (``PoppedResults.heads``), parsed once per pop: every
        result of one pop shares the same list object."""
        cached = self._last_order
        if cached is not None and cached[0] is wire:
            return cached[1]
        heads = [(int(layer), int(head)) for layer, head in wire]
        row = {h: i for i, h in enumerate(heads)}
        rows = None
        if self._config_heads <= row.keys():
            rows = np.array([row[h] for h in self.config.heads], dtype=np.int64)
        order = _HeadOrder(heads, rows, row)
        self._last_order = (wire, order)
        return order


def _floats(data: bytes) -> tuple[float, ...]:
    """A float64 vector as it travels from the worker (``ProbeResultData``)."""
    return tuple(np.frombuffer(data, dtype=np.float64).tolist())


@dataclass(frozen=True)
class _HeadOrder:
    """One rank's head order: the heads of its stats rows, and where the config's heads sit
    among them (None when the rank lacks some)."""

    heads: list[HeadKey]
    config_rows: np.ndarray | None
    index: dict[HeadKey, int]  # head -> its row


def _head_tables(
    tables: list[tuple[_HeadOrder, np.ndarray]],
) -> tuple[Mapping[HeadKey, tuple[float, ...]], Mapping[HeadKey, float]]:
    """A request's head stats and focus per head from its ranks' tables: one rank's table as it
    came (values made on access), several ranks' merged into dicts."""
    if len(tables) == 1:
        order, table = tables[0]
        return HeadStats(order.index, table), HeadScores(order.index, np.asarray(focus_of(table)))
    stats: dict[HeadKey, tuple[float, ...]] = {}
    scores: dict[HeadKey, float] = {}
    for order, table in tables:
        stats.update(zip(order.heads, map(tuple, table.tolist()), strict=True))
        scores.update(zip(order.heads, focus_of(table).tolist(), strict=True))
    return stats, scores
