"""A model's configs from the calibration pool: what ``guardrail calibrate`` without ``--data``
fits, and the one writer of the shipped SmolLM2 configs.

From rows the serving probe scored once (every head; the last-token and data-mean streams of
the recipe's candidate layers), :func:`calibrate_on_pool` fits two probes of
:mod:`guardrail.offline.transfer` on the calibration rows:

- ``attention``: attention features only; it runs in any engine mode (``<name>.json``);
- ``combined``: the same heads with the last-token stream of the two best candidate layers and
  the data-mean stream of the first of them, and, when the scores hold sampled token streams
  and a second pass is given (``top_logits_of``), a token-level read-out of that layer over
  the data tokens (:mod:`guardrail.offline.token_fit`) where it raises the pool's CV AUROC
  (``<name>.combined.json``);

and measures both on each source left out of the fit.
:func:`guardrail.offline.pool_report.write_pool_calibration` writes the two configs and the
report beside them. Everything is deterministic: the same scores give the same files, byte for
byte.

Example:
    >>> result = calibrate_on_pool(pool, ModelShape.of("my/model-dir", "my/model"),
    ...                            "the pool", recipe_for("my/model", 32))  # doctest: +SKIP
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from guardrail.errors import ConfigError
from guardrail.offline.calibration import recorded_threshold
from guardrail.offline.datasets import pairs_sha256
from guardrail.offline.token_fit import TokenReadoutFit, TopLogits, fit_token_readout
from guardrail.offline.transfer import (
    LeftOut,
    Measured,
    ProbeFit,
    ScoredPool,
    TransferRecipe,
    choose_attention_layers,
    choose_hidden_layers,
    fit_probe,
    leave_one_source_out,
    per_layout,
)
from guardrail.probe.config import Calibration, ModelProbeConfig

__all__ = [
    "ModelShape",
    "OperatingPoint",
    "PoolCalibration",
    "Spread",
    "calibrate_on_pool",
    "operating_points",
    "spread",
    "token_read_layers",
]

WRITER = "guardrail calibrate"
"""How a config written here names its writer (its ``source`` field)."""


@dataclass(frozen=True)
class ModelShape:
    """What a config records about its model: id and sizes (from the model's config.json)."""

    model_id: str
    num_layers: int
    num_heads: int
    num_kv_heads: int | None
    hidden_size: int

    @classmethod
    def of(cls, model: str, model_id: str) -> ModelShape:
        """The shape of ``model`` (a directory or a Hugging Face id)."""
        path = Path(model) / "config.json"
        if path.is_file():
            raw: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        else:
            from transformers import AutoConfig

            raw = AutoConfig.from_pretrained(model).to_dict()
        raw = raw.get("text_config") or raw
        return cls(
            model_id=model_id,
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            num_kv_heads=raw.get("num_key_value_heads"),
            hidden_size=int(raw["hidden_size"]),
        )


class Spread(TypedDict):
    """A threshold's effect on several sources' rows: the largest share of clean rows flagged
    in any source, the share of all injections caught, and the smallest share caught in any
    source (None: no such rows)."""

    flagged_clean_worst: float | None
    caught: float | None
    caught_worst: float | None


class OperatingPoint(TypedDict):
    """One operating point of a calibrated probe: the threshold that flags at most ``rate`` of
    the clean rows of every calibration source (out-of-fold focus; ``ModelProbeConfig
    .threshold_at(rate)``), measured on the pool out of fold (``pool``: in sample for the
    threshold, which was set on those rows) and on each source left out of the fit, at the
    threshold that fit set by the same rule without it (``left_out``: what a kind of traffic
    the calibration never saw gets)."""

    rate: float
    threshold: float
    pool: Spread
    left_out: Spread | None


def spread(parts: list[tuple[np.ndarray, np.ndarray, float]]) -> Spread:
    """:class:`Spread` of ``parts`` = one ``(labels, focus, threshold)`` per source.

    Example:
        >>> a = (np.array([0, 0, 1]), np.array([0.9, 0.1, 0.2]), 0.5)
        >>> b = (np.array([0, 1, 1]), np.array([0.8, 0.1, 0.9]), 0.5)
        >>> spread([a, b])
        {'flagged_clean_worst': 0.5, 'caught': 0.6667, 'caught_worst': 0.5}
    """
    flagged = [float((f[y == 0] <= t).mean()) for y, f, t in parts if (y == 0).any()]
    caught = [int((f[y == 1] <= t).sum()) for y, f, t in parts]
    injected = [int((y == 1).sum()) for y, _, _ in parts]
    each = [c / n for c, n in zip(caught, injected, strict=True) if n]
    return {
        "flagged_clean_worst": round(max(flagged), 4) if flagged else None,
        "caught": round(sum(caught) / sum(injected), 4) if sum(injected) else None,
        "caught_worst": round(min(each), 4) if each else None,
    }


def operating_points(
    pool: ScoredPool, probe: ProbeFit, left_out: dict[str, LeftOut]
) -> list[OperatingPoint]:
    """``probe``'s operating points (``OPERATING_RATES``; the probe fitted on the pool's
    calibration rows), with ``left_out``: the same kind fitted without each source."""
    index = pool.calibration
    sources = pool.corpus[index]
    points: list[OperatingPoint] = []
    for rate, threshold in sorted(probe.operating.items()):
        in_pool = [
            (pool.labels[index][mask], probe.fit.oof_focus[mask], threshold)
            for source in sorted(set(sources.tolist()))
            for mask in [sources == source]
        ]
        unseen = [(left.labels, left.focus, left.operating[rate]) for left in left_out.values()]
        points.append(
            {
                "rate": rate,
                "threshold": recorded_threshold(threshold),
                "pool": spread(in_pool),
                "left_out": spread(unseen) if unseen else None,
            }
        )
    return points


@dataclass(frozen=True)
class PoolCalibration:
    """What :func:`calibrate_on_pool` found: the layers, both probes and their configs, the
    pool fit's out-of-fold results per source and layout, and each source left out."""

    recipe: TransferRecipe
    layer_cv_auroc: dict[int, float]
    probes: dict[str, ProbeFit]
    configs: dict[str, ModelProbeConfig]
    out_of_fold: dict[str, dict[str, dict[str, Measured]]]  # kind -> source -> layout
    left_out: dict[str, dict[str, LeftOut]]  # source -> kind
    sources: list[str]
    layouts: list[str]
    token: TokenReadoutFit | None = None  # the token read-out's fits (None: not tried)
    operating_points: dict[str, list[OperatingPoint]] = field(default_factory=dict)  # by kind


def _source_text(probe: ProbeFit) -> str:
    text = (
        f"{WRITER}: L1 logistic on {probe.fit.feature} of the heads of layers "
        f"{list(probe.attention_layers)}"
    )
    if probe.last_layers:
        layers = list(probe.last_layers)
        text += f" and the residual stream at the last prompt token of layers {layers}"
    if probe.data_mean_layers:
        text += f" and averaged over the data tokens of layers {list(probe.data_mean_layers)}"
    for _, column in sorted(probe.data_top.items()):
        token = column.model.layers
        read = f"layer {token[0]}" if len(token) == 1 else f"layers {list(token)}"
        text += (
            f" and a token model's {column.top_k} highest logits over the data tokens of {read} "
            f"(C={column.model.c:g})"
        )
    return text + ", from the serving probe"


def _config(
    probe: ProbeFit, shape: ModelShape, pool: ScoredPool, dataset: str, recipe: TransferRecipe
) -> ModelProbeConfig:
    """``probe`` (fitted on the pool's calibration rows) as a config with its provenance."""
    index = pool.calibration
    rows = [pool.rows[i] for i in index]
    fpr = recipe.target_fpr
    at = f"fpr@{fpr:g}"
    thresholds = {f"worst-source {at}": recorded_threshold(probe.threshold)}
    thresholds.update({f"{k} {at}": recorded_threshold(v) for k, v in probe.per_source.items()})
    thresholds.update(  # the other operating points (``ModelProbeConfig.threshold_at``)
        {f"worst-source fpr@{rate:g}": recorded_threshold(t) for rate, t in probe.operating.items()}
    )
    return ModelProbeConfig(
        model_id=shape.model_id,
        **probe.fit.probe_fields(),
        threshold=recorded_threshold(probe.threshold),
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        hidden_size=shape.hidden_size,
        source=_source_text(probe),
        calibration=Calibration(
            dataset=f"{len(rows)} rows of {dataset}",
            num_examples=len(rows),
            sha256=pairs_sha256(rows),
            thresholds=thresholds,
            notes=f"C={probe.fit.c} by grouped {recipe.folds}-fold CV (AUROC "
            f"{probe.fit.cv_auroc:.4f}); the threshold flags at most {fpr:g} of the clean rows "
            "of every calibration source (out-of-fold focus)",
            max_data_tokens=int(max(pool.table.data_tokens[index])),
        ),
    )


def token_read_layers(
    first: int, ranked: dict[int, float], sampled: set[int], count: int
) -> tuple[int, ...]:
    """The layers the token read-out reads (ascending): ``first`` (the data-mean layer), then
    the candidate layers of the best hidden-only CV AUROC in ``ranked`` whose token streams
    were sampled, ``count`` in all.

    Example:
        >>> token_read_layers(15, {13: 0.86, 15: 0.89, 18: 0.889, 21: 0.88}, {13, 15, 18, 21}, 3)
        (15, 18, 21)
    """
    others = sorted(
        (layer for layer in ranked if layer in sampled and layer != first),
        key=lambda layer: (-ranked[layer], layer),
    )
    return tuple(sorted([first, *others[: max(count - 1, 0)]]))


def calibrate_on_pool(
    pool: ScoredPool,
    shape: ModelShape,
    dataset: str,
    recipe: TransferRecipe,
    progress: Callable[[str], None] | None = None,
    top_logits_of: TopLogits | None = None,
    token_device: str | None = None,
    token_models_cache: Path | None = None,
) -> PoolCalibration:
    """Both probes fitted on ``pool``'s calibration rows by ``recipe``, their configs, and the
    leave-one-source-out measurements. ``dataset`` describes the rows (the configs record it
    after their count: "<n> rows of <dataset>"); ``progress(step)`` is called after each fit.
    ``top_logits_of`` (the token read-out's second pass) tries the token read-out when the
    scores hold sampled token streams of the data-mean layer; ``token_device``: where its token
    models are fitted (None: scikit-learn on the host;
    :func:`guardrail.offline.token_readout.fit_tokens`); ``token_models_cache``: a file that
    keeps them, so a run cut short after them resumes without fitting them again."""
    step = progress or (lambda _: None)
    index = pool.calibration
    if len(set(pool.labels[index].tolist())) < 2:
        raise ConfigError(
            f"calibration needs clean and injected rows; got {len(index)} scored rows with "
            f"labels {sorted(set(pool.labels[index].tolist()))}"
        )
    attention = choose_attention_layers(pool, index, recipe)
    step("attention layers")
    last, layer_cv = choose_hidden_layers(pool, index, recipe, lambda layer: step(f"layer {layer}"))
    means = recipe.data_mean_layers if recipe.data_mean_layers is not None else last[:1]
    probes = {"attention": fit_probe(pool, "attention", index, recipe, attention)}
    token = None
    if top_logits_of is not None and means and means[0] in pool.table.tokens:
        read = token_read_layers(means[0], layer_cv, set(pool.table.tokens), recipe.token_layers)
        token = fit_token_readout(
            pool,
            index,
            recipe,
            attention,
            last,
            means,
            read,
            top_logits_of,
            step,
            token_device,
            token_models_cache,
        )
    probes["combined"] = (
        fit_probe(pool, "combined", index, recipe, attention, last, means)
        if token is None
        else token.probe  # fitted while choosing the read-out: with it, or without it
    )
    step("pool fits")
    configs = {kind: _config(probe, shape, pool, dataset, recipe) for kind, probe in probes.items()}
    out_of_fold = {
        kind: {
            source: per_layout(pool, index[mask], probe.fit.oof_focus[mask], probe.threshold)
            for source in sorted(set(pool.corpus[index].tolist()))
            for mask in [pool.corpus[index] == source]
        }
        for kind, probe in probes.items()
    }
    left_out = leave_one_source_out(
        pool,
        probes,
        recipe,
        lambda s: step(f"{s} left out"),
        None if token is None else token.left_out,
    )
    return PoolCalibration(
        recipe=recipe,
        layer_cv_auroc=layer_cv,
        probes=probes,
        configs=configs,
        out_of_fold=out_of_fold,
        left_out=left_out,
        sources=sorted(set(pool.corpus[index].tolist())),
        layouts=sorted(set(pool.layout[index].tolist())),
        token=token,
        operating_points={
            kind: operating_points(
                pool, probe, {s: by_kind[kind] for s, by_kind in left_out.items()}
            )
            for kind, probe in probes.items()
        },
    )
