"""Scores of rows: per-head attention stats (and hidden streams) through the serving probe, a
score cache that keeps them between runs, and the focus a config gives the scored rows.

Calibration, evaluation and re-thresholding all read rows this way, so they measure what
serving measures. Settings are plain data (:class:`ScoringSettings`); the ``guardrail`` CLI
builds them from its arguments, benchmarks and notebooks build them directly.

Example:
    >>> settings = ScoringSettings(scores_cache=Path("scores.npz"), hidden_layers=(9,))
    >>> rows, table, skipped, seconds = scores_for(pairs, "my/model", "all",
    ...                                            settings)  # doctest: +SKIP
    >>> config_focus(config, table)  # one focus per kept row  # doctest: +SKIP
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tqdm.auto import tqdm

from guardrail.errors import ConfigError, GuardrailError, RequestError
from guardrail.offline.datasets import LabelledPair, ScoreTable, content_key
from guardrail.offline.layouts import request_for
from guardrail.offline.token_readout import TOKENS_PER_ROW
from guardrail.probe.config import HiddenPosition, ModelProbeConfig
from guardrail.probe.scoring import ATTENTION_STATS, HeadKey

__all__ = [
    "ScoredRows",
    "ScoringSettings",
    "config_focus",
    "layers_read_by",
    "open_engine",
    "score_pairs",
    "scores_for",
]

Checkpoint = Callable[[ScoreTable, list[dict[str, str]]], None]
CHECKPOINT_S = 60.0
"""Scoring saves its progress at most this often (seconds)."""


@dataclass(frozen=True)
class ScoringSettings:
    """How rows are scored: the score cache, batches, prompt limit, the hidden layers read,
    and the engine :func:`open_engine` starts when the caller gives none.

    ``hidden_layers``: layers whose residual stream at the last prompt token is read;
    ``data_mean_layers``: layers whose stream averaged over the data tokens is read.
    ``token_samples``: per row, the whole streams of the data-mean layers at this many sampled
    positions are kept too (:func:`guardrail.offline.token_readout.sample_positions`).
    ``engine_args``: any further vLLM engine argument (it wins over the fields above).
    """

    scores_cache: Path | None = None
    batch_size: int = 32
    max_prompt_tokens: int | None = None
    hidden_layers: tuple[int, ...] = ()
    data_mean_layers: tuple[int, ...] = ()
    token_samples: int = 0
    max_model_len: int = 4096
    max_num_batched_tokens: int = 4096
    dtype: str | None = None
    seed: int = 0
    engine_args: Mapping[str, Any] = field(default_factory=dict, hash=False)


class ScoredRows(NamedTuple):
    """What :func:`scores_for` returns: the rows kept, their scores (one table row each, in
    the same order), the rows skipped with the reason, and the seconds it took."""

    pairs: list[LabelledPair]
    table: ScoreTable
    skipped: list[dict[str, str]]
    seconds: float


def open_engine(
    model: str,
    heads: Sequence[HeadKey] | str,
    settings: ScoringSettings,
    config: ModelProbeConfig | None = None,
) -> Any:
    """Start a ``HookedLLM`` that scores ``heads`` ("all" for calibration) and reads the
    settings' hidden layers; with ``config``, one that serves that config instead. Sets
    ``VLLM_CPU_KVCACHE_SPACE=2`` unless already set."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from guardrail.engine import HookedLLM

    first: list[HeadKey] = [(0, 0)] if isinstance(heads, str) else [tuple(heads[0])]  # type: ignore[list-item]
    # Only head_stats are used; the model path as id keeps the served-model check quiet.
    placeholder = ModelProbeConfig(model_id=str(model), heads=first)
    engine_kwargs: dict[str, Any] = {
        "enforce_eager": True,  # fast start, no compilation for a scoring pass
        "max_model_len": settings.max_model_len,
        "seed": settings.seed,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        **({} if settings.dtype is None else {"dtype": settings.dtype}),
        **dict(settings.engine_args),  # any vLLM argument; it wins
    }
    if config is not None:
        return HookedLLM(model, config, **engine_kwargs)
    return HookedLLM(
        model,
        placeholder,
        probe_heads=heads,
        probe_hidden_layers=list(settings.hidden_layers),
        probe_data_mean_layers=list(settings.data_mean_layers),
        **engine_kwargs,
    )


# -- scoring through the engine ---------------------------------------------------------------


class _Collected:
    """Scores gathered batch by batch; :meth:`table` turns what is held into a ScoreTable."""

    def __init__(
        self, heads: list[HeadKey], hidden: list[int], means: list[int], tokens: bool = False
    ) -> None:
        self.heads = heads
        self.keys: list[str] = []
        self.values: list[list[Any]] = []
        self.prompt_tokens: list[int] = []
        self.data_tokens: list[int] = []
        self.streams: dict[int, list[Any]] = {layer: [] for layer in hidden}
        self.means: dict[int, list[Any]] = {layer: [] for layer in means}
        self.tokens: dict[int, list[np.ndarray]] | None = (
            {layer: [] for layer in means} if tokens else None
        )
        self.token_counts: list[int] = []

    def add(self, pair: LabelledPair, out: Any, positions: list[int] | None = None) -> str | None:
        """Keep the scores of ``pair`` in the engine's output ``out``, or say why it cannot."""
        probe = out.probe
        if out.error is not None or probe is None or not probe.head_stats:
            return str(out.error or (probe.error if probe else "no probe result"))
        if any(layer not in probe.data_mean_states for layer in self.means):
            return "no data tokens to average"
        if self.tokens is not None:
            states = probe.token_states
            if positions and sorted(states) != sorted(self.tokens):
                return f"token streams of layers {sorted(states)}, not {sorted(self.tokens)}"
            if positions and not all(np.isfinite(states[layer]).all() for layer in self.tokens):
                return "a sampled token's stream is not finite (never computed in this engine?)"
            for layer, kept in self.tokens.items():
                size = len(probe.data_mean_states[layer])
                none = np.zeros((0, size), np.float16)
                kept.append(states[layer].astype(np.float16) if positions else none)
            self.token_counts.append(len(positions or []))
        self.keys.append(content_key(pair))
        self.values.append([probe.head_stats[h] for h in self.heads])
        for layer, rows in self.streams.items():
            rows.append(probe.hidden_states[layer])
        for layer, rows in self.means.items():
            rows.append(probe.data_mean_states[layer])
        self.prompt_tokens.append(probe.num_prompt_tokens)
        self.data_tokens.append(out.prompt.num_data_tokens)
        return None

    def table(self, model: str) -> ScoreTable:
        n = len(self.keys)
        tokens: dict[int, np.ndarray] = {}
        offsets = None
        if self.tokens is not None:
            offsets = np.r_[0, np.cumsum(self.token_counts)].astype(np.int64)
            tokens = {
                layer: np.concatenate(kept) if kept else np.zeros((0, 0), np.float16)
                for layer, kept in self.tokens.items()
            }
        return ScoreTable(
            model,
            self.heads,
            list(self.keys),
            np.asarray(self.values, dtype=float).reshape(-1, len(self.heads), len(ATTENTION_STATS)),
            np.asarray(self.prompt_tokens),
            np.asarray(self.data_tokens),
            hidden={
                layer: np.asarray(rows, dtype=np.float32).reshape(n, -1)
                for layer, rows in self.streams.items()
            },
            data_mean={
                layer: np.asarray(rows, dtype=np.float32).reshape(n, -1)
                for layer, rows in self.means.items()
            },
            tokens=tokens,
            token_offsets=offsets,
        )


def _rows_that_fit(
    engine: Any, pairs: Sequence[LabelledPair], max_prompt_tokens: int | None
) -> tuple[list[tuple[LabelledPair, Any]], list[dict[str, str]]]:
    """(rows to score with their rendered prompts, rows skipped with the reason): the
    engine's rendering refuses some rows; others are longer than ``max_prompt_tokens``."""
    todo, skipped = [], []
    for pair in pairs:
        try:
            prepared = engine.prepare(request_for(pair))
        except RequestError as exc:
            skipped.append({"id": pair.id, "reason": str(exc)[:160]})
            continue
        if max_prompt_tokens and len(prepared.token_ids) > max_prompt_tokens:
            reason = (
                f"{len(prepared.token_ids)} prompt tokens > --max-prompt-tokens {max_prompt_tokens}"
            )
            skipped.append({"id": pair.id, "reason": reason})
            continue
        todo.append((pair, prepared))
    return todo, skipped


def _score_chunk(
    engine: Any,
    chunk: Sequence[tuple[LabelledPair, Any]],
    collected: _Collected,
    skipped: list[dict[str, str]],
    token_samples: int,
) -> None:
    """Score one batch of rows (with their rendered prompts, ``_rows_that_fit``) into
    ``collected``, with sampled token streams when asked."""
    from guardrail.offline.token_readout import sample_positions

    requests = [request_for(p) for p, _ in chunk]
    if token_samples:
        positions: list[list[int] | None] = [
            sample_positions(prepared, p, engine.tokenizer, token_samples) for p, prepared in chunk
        ]
        outs = engine.score(requests, stream_positions=positions)
    else:
        positions, outs = [None] * len(chunk), engine.score(requests)
    for (pair, _), out, at in zip(chunk, outs, positions, strict=True):
        reason = collected.add(pair, out, at)
        if reason is not None:
            skipped.append({"id": pair.id, "reason": reason[:160]})


def score_pairs(
    engine: Any,
    pairs: Sequence[LabelledPair],
    batch_size: int = 32,
    max_prompt_tokens: int | None = None,
    model: str = "",
    checkpoint: Checkpoint | None = None,
    token_samples: int = 0,
) -> tuple[ScoreTable, list[dict[str, str]]]:
    """Per-head attention stats of each row through the engine's probe; also the rows it skipped.

    Rows longer than ``max_prompt_tokens`` or the engine's context, and rows the probe could
    not score, are skipped and listed with the reason. ``checkpoint`` is called with what was
    scored so far after a batch, at most every ``CHECKPOINT_S`` seconds, and when scoring is
    stopped or fails (the score cache saves it, so a stopped run resumes; with token streams
    the file is large).
    ``token_samples``: keep the streams of the data-mean layers at this many sampled positions
    per row (``ScoreTable.tokens``).
    """
    collected = _Collected(
        list(engine.probe_heads),
        list(getattr(engine, "probe_hidden_layers", [])),
        list(getattr(engine, "probe_data_mean_layers", [])),
        tokens=token_samples > 0,
    )
    todo, skipped = _rows_that_fit(engine, pairs, max_prompt_tokens)
    bar = tqdm(total=len(todo), desc="scoring", unit="row", disable=len(todo) == 0)
    saved = time.perf_counter()
    try:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            _score_chunk(engine, chunk, collected, skipped, token_samples)
            bar.update(len(chunk))
            due = time.perf_counter() - saved >= CHECKPOINT_S
            if checkpoint is not None and due and start + batch_size < len(todo):
                checkpoint(collected.table(model), skipped)
                saved = time.perf_counter()
    except BaseException:  # stopped (Ctrl-C) or failed: keep what was scored
        if checkpoint is not None and collected.keys:
            checkpoint(collected.table(model), skipped)
        raise
    bar.close()
    started = time.perf_counter()
    table = collected.table(model)
    _phase(f"{len(table.keys)} rows' scores gathered in {time.perf_counter() - started:.0f} s")
    return table, skipped


# -- the score cache ------------------------------------------------------------------------


def _load_cache(settings: ScoringSettings, model: str) -> ScoreTable | None:
    """The score cache, when there is one, checked to hold ``model`` and the layers asked for."""
    path = settings.scores_cache
    if path is None or not path.exists():
        return None
    cache = ScoreTable.load(path)
    if cache.model != model:
        raise GuardrailError(
            f"--scores-cache {path} holds scores of {cache.model!r}, not {model!r}: use "
            "another cache file"
        )
    reads = [
        ("hidden states", sorted(settings.hidden_layers), cache.hidden),
        ("data-mean states", sorted(settings.data_mean_layers), cache.data_mean),
    ]
    for what, wanted, held in reads:
        if not set(wanted) <= set(held):
            raise GuardrailError(
                f"--scores-cache {path} holds {what} of layers {sorted(held)}, not the "
                f"{wanted} asked for: use another cache file"
            )
    if settings.token_samples and cache.token_offsets is None:
        raise GuardrailError(
            f"--scores-cache {path} holds no sampled token streams, which the token read-out "
            "is fitted on: use another cache file (it was written before guardrail kept them)"
        )
    return cache


def _score_missing(
    missing: Sequence[LabelledPair],
    model: str,
    heads: Sequence[HeadKey] | str,
    settings: ScoringSettings,
    cache: ScoreTable | None,
    engine: Any,
) -> tuple[ScoreTable, list[dict[str, str]]]:
    """Score the rows the cache lacks; (the cache with them added, rows skipped). With a
    cache file, every head is scored (so it serves any later config), new rows are read like
    the cached ones, and progress is saved after every batch."""
    if cache is not None:  # new rows are read like the cached ones
        settings = replace(
            settings,
            hidden_layers=tuple(sorted(cache.hidden)),
            data_mean_layers=tuple(sorted(cache.data_mean)),
            token_samples=(settings.token_samples or TOKENS_PER_ROW)
            if cache.token_offsets is not None
            else 0,
        )
    path = settings.scores_cache
    by_id = {p.id: content_key(p) for p in missing}

    def with_known(fresh: ScoreTable, new_skips: list[dict[str, str]]) -> ScoreTable:
        fresh.skipped = {by_id[row["id"]]: row["reason"] for row in new_skips}
        return fresh if cache is None else cache.merged(fresh)

    checkpoint: Checkpoint | None = None
    if path is not None:

        def save_progress(fresh: ScoreTable, new_skips: list[dict[str, str]]) -> None:
            with_known(fresh, new_skips).save(path)

        checkpoint = save_progress
    own = engine is None
    engine = engine or open_engine(model, "all" if path else heads, settings)
    try:
        fresh, new_skips = score_pairs(
            engine,
            missing,
            settings.batch_size,
            settings.max_prompt_tokens,
            model,
            checkpoint,
            settings.token_samples,
        )
    finally:
        if own:
            started = time.perf_counter()
            engine.close()
            _phase(f"engine closed in {time.perf_counter() - started:.0f} s")
    merged = with_known(fresh, new_skips)
    if path is not None:
        started = time.perf_counter()
        merged.save(path)
        took, size = time.perf_counter() - started, path.stat().st_size / 2**30
        _phase(f"score cache {path} saved ({size:.1f} GiB) in {took:.0f} s")
    return merged, new_skips


def _phase(line: str) -> None:
    """A step of a long scoring run, between its progress bars (on stderr, as they are): where
    the time goes after the last row is scored is otherwise invisible."""
    tqdm.write(line, file=sys.stderr)


def scores_for(
    pairs: Sequence[LabelledPair],
    model: str,
    heads: Sequence[HeadKey] | str,
    settings: ScoringSettings | None = None,
    engine: Any = None,
) -> ScoredRows:
    """Scores of ``pairs`` from the cache and/or the engine (started from ``settings`` when
    ``engine`` is None, and closed after).

    The returned table's rows line up with the returned pairs. With a cache, every head is
    scored (so the cache serves any later config) and new rows are added to the file.
    """
    started = time.perf_counter()
    settings = settings or ScoringSettings()
    cache = _load_cache(settings, model)
    found = set(cache.rows(pairs)[0]) if cache is not None else set()
    known_skips = cache.skipped if cache is not None else {}
    skipped = [
        {"id": p.id, "reason": known_skips[content_key(p)]}
        for p in pairs
        if content_key(p) in known_skips
    ]
    missing = [
        p for i, p in enumerate(pairs) if i not in found and content_key(p) not in known_skips
    ]
    if missing:
        cache, new_skips = _score_missing(missing, model, heads, settings, cache, engine)
        skipped += new_skips
    if cache is None:
        raise ConfigError("no rows to score")
    index, rows = cache.rows(pairs)
    kept = [pairs[i] for i in index]
    return ScoredRows(kept, cache.select(rows), skipped, time.perf_counter() - started)


# -- a config's focus on scored rows --------------------------------------------------------


def layers_read_by(configs: Sequence[ModelProbeConfig], position: HiddenPosition) -> list[int]:
    """The decoder layers whose hidden state at ``position`` any of ``configs`` reads, sorted:
    what :class:`ScoringSettings` must read for :func:`config_focus` to score them.

    Example:
        >>> layers_read_by([ModelProbeConfig(model_id="m", heads=[(0, 0)])], "last")
        []
    """
    return sorted({layer for config in configs for layer in config.hidden_layers_at(position)})


def _check_table_serves(config: ModelProbeConfig, table: ScoreTable) -> None:
    """A ConfigError unless ``table`` holds every head and hidden stream ``config`` reads."""
    tops = config.hidden_layers_at("data_top")
    if tops:
        raise ConfigError(
            f"config {config.model_id!r} reads layers {tops} at position 'data_top' (the data "
            "tokens' highest values), which a score table cannot hold (it keeps one stream per "
            "row): measure it through an engine serving it (guardrail.offline.served, which "
            "`guardrail evaluate` and `guardrail threshold` use for it)"
        )
    held_heads = set(table.heads)
    missing = [h for h in config.heads if h not in held_heads]
    if missing:
        raise ConfigError(
            f"scores lack heads {missing[:5]} of config {config.model_id!r}; "
            "score with every head (use a fresh --scores-cache)"
        )
    reads: list[tuple[HiddenPosition, dict[int, np.ndarray], str]] = [
        ("last", table.hidden, "--hidden-layers"),
        ("data_mean", table.data_mean, "--data-mean-layers"),
    ]
    for position, held, flag in reads:
        needed = config.hidden_layers_at(position)
        lacking = [layer for layer in needed if layer not in held]
        if lacking:
            raise ConfigError(
                f"config {config.model_id!r} reads the hidden state of layers {lacking} at "
                f"position {position!r}, which the scores lack (they hold layers "
                f"{sorted(held)}): score with {flag} {' '.join(map(str, needed))} (and a fresh "
                "--scores-cache)"
            )


def config_focus(config: ModelProbeConfig, table: ScoreTable) -> np.ndarray:
    """The focus score ``config`` gives each row of ``table`` (which must hold its heads, and
    the hidden streams of its hidden layers when it reads any): shape ``[rows]``."""
    _check_table_serves(config, table)
    column = {h: j for j, h in enumerate(table.heads)}
    cols = [column[h] for h in config.heads]
    terms: list[dict[int, float]] = []
    for i in range(len(table.keys)):
        row: dict[int, float] = {}
        for part in config.hidden or []:
            streams = table.hidden if part.position == "last" else table.data_mean
            row[part.layer] = row.get(part.layer, 0.0) + part.project(streams[part.layer][i])
        terms.append(row)
    return np.array(
        [
            config.focus(dict(zip(config.heads, row[cols], strict=True)), terms[i])
            for i, row in enumerate(table.values)
        ]
    )
