"""Passes through an engine beyond what a score table holds: the token read-out's second pass
(every data token's stream, reduced to each token model's highest logits) and the focus of an
engine serving a config whose read-out no table holds (``data_top``).

Example:
    >>> tops = top_token_logits(pairs, models, "my/model", settings)  # doctest: +SKIP
    >>> focus = focus_of(config, table, pairs, "my/model", settings)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from guardrail.errors import ConfigError, GuardrailError
from guardrail.offline.datasets import LabelledPair, ScoreTable, content_key
from guardrail.offline.layouts import request_for
from guardrail.offline.row_scores import ScoringSettings, config_focus, open_engine
from guardrail.offline.token_readout import TOP, TokenModel, models_sha256, top_logits
from guardrail.probe.config import ModelProbeConfig

__all__ = ["focus_of", "served_focus", "top_token_logits"]


def top_token_logits(
    pairs: Sequence[LabelledPair],
    models: Sequence[TokenModel],
    model: str,
    settings: ScoringSettings,
    engine: Any = None,
    cache: Path | None = None,
) -> np.ndarray:
    """``[rows, models, TOP]``: each token model's ``TOP`` highest logits over each row's data
    tokens (descending, NaN past the row's data tokens), from every data token's streams
    through the serving probe (:func:`guardrail.offline.token_readout.top_logits`). The
    models read the same layers; ``engine`` (None: one is started with those layers' streams,
    and closed after) must keep their whole streams. ``cache`` keeps the result for these rows
    and models (a digest of their numbers) between runs."""
    keys = [content_key(p) for p in pairs]
    digest = models_sha256(models)
    if cache is not None and cache.exists():
        with np.load(cache) as held:
            if str(held["models"]) == digest and held["keys"].tolist() == keys:
                return np.asarray(held["tops"])
    read = sorted({m.layers for m in models})
    if len(read) != 1:
        raise ConfigError(f"token models of the same layers only, not of layers {read}")
    layers = read[0]
    own = engine is None
    if own:
        engine = open_engine(
            model, [(0, 0)], replace(settings, hidden_layers=(), data_mean_layers=layers)
        )
    else:
        lacking = sorted(set(layers) - set(getattr(engine, "probe_data_mean_layers", [])))
        if lacking:
            raise ConfigError(f"the engine does not keep the whole streams of layers {lacking}")
    tops = np.full((len(pairs), len(models), TOP), np.nan)
    try:
        bar = tqdm(total=len(pairs), desc="token read-out", unit="row", disable=not pairs)
        for start in range(0, len(pairs), settings.batch_size):
            chunk = pairs[start : start + settings.batch_size]
            requests = [request_for(p) for p in chunk]
            positions = [
                [t for a, b in engine.prepare(r).data_spans for t in range(a, b)] for r in requests
            ]
            outs = engine.score(requests, stream_positions=positions)
            for j, (pair, out) in enumerate(zip(chunk, outs, strict=True)):
                probe = out.probe
                held = {} if probe is None else probe.token_states
                states = (
                    np.concatenate([held[layer] for layer in layers], axis=1)
                    if all(layer in held for layer in layers)
                    else None
                )
                if out.error is not None or probe is None or probe.error or states is None:
                    why = out.error or (probe.error if probe else "no probe result")
                    raise GuardrailError(f"token read-out: row {pair.id} was not scored: {why}")
                if not np.isfinite(states).all():
                    raise GuardrailError(f"token read-out: row {pair.id}: a stream is not finite")
                tops[start + j] = top_logits(states, models)
            bar.update(len(chunk))
        bar.close()
    finally:
        if own:
            engine.close()
    if cache is not None:
        np.savez_compressed(cache, models=np.array(digest), keys=np.array(keys), tops=tops)
    return tops


def served_focus(
    pairs: Sequence[LabelledPair], model: str, config: ModelProbeConfig, settings: ScoringSettings
) -> np.ndarray:
    """The focus an engine serving ``config`` gives each of ``pairs``, in order: how a config
    whose read-out a score table cannot hold (``data_top``) is measured. A row the probe could
    not score is an error naming it (``pairs`` should be rows a scoring pass kept)."""
    engine = open_engine(model, config.heads, settings, config)
    focus = np.empty(len(pairs))
    try:
        bar = tqdm(total=len(pairs), desc="served focus", unit="row", disable=not pairs)
        for start in range(0, len(pairs), settings.batch_size):
            chunk = pairs[start : start + settings.batch_size]
            for j, (pair, out) in enumerate(
                zip(chunk, engine.score([request_for(p) for p in chunk]), strict=True)
            ):
                probe = out.probe
                if out.error is not None or probe is None or probe.focus is None:
                    why = out.error or (probe.error if probe else "no probe result")
                    raise GuardrailError(
                        f"row {pair.id} was not scored by the served config: {why}"
                    )
                focus[start + j] = probe.focus
            bar.update(len(chunk))
        bar.close()
    finally:
        engine.close()
    return focus


def focus_of(
    config: ModelProbeConfig,
    table: ScoreTable,
    pairs: Sequence[LabelledPair],
    model: str,
    settings: ScoringSettings,
) -> np.ndarray:
    """The focus ``config`` gives ``pairs`` (the rows of ``table``, in order): from the table
    (:func:`config_focus`), or through an engine serving it when it reads the data tokens'
    highest values, which no table holds (:func:`served_focus`)."""
    if config.hidden_layers_at("data_top"):
        return served_focus(pairs, model, config, settings)
    return config_focus(config, table)
